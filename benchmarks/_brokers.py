"""The brokers a scenario runs against, and the host line every scenario prints.

``redis`` is the benchmark's own server (:mod:`benchmarks._server`); ``amqp`` is RabbitMQ at
``--amqp-url`` (``$REDSEM_BENCH_AMQP_URL``, default ``amqp://guest:guest@127.0.0.1:5672//``),
skipped with a printed line when nothing answers there. Results, semaphores and the bodies'
records always stay on the Redis server. A run's tasks go to a queue named after its unique
prefix, which is deleted afterwards.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import celery
from celery import Celery

__all__ = [
    "AMQP_URL",
    "Broker",
    "amqp_broker",
    "broker_leg",
    "broker_legs",
    "drop_queue",
    "host_line",
    "isolated_app",
]

AMQP_URL = os.environ.get("REDSEM_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


@dataclass(frozen=True)
class Broker:
    """A broker leg: its name (``redis``, ``amqp``), URL and server version."""

    name: str
    url: str
    version: str

    @property
    def is_redis(self) -> bool:
        return self.name == "redis"


def amqp_broker(url: str) -> Broker | str:
    """The RabbitMQ broker at ``url``, or why it cannot be used (nothing answers, no login)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5672
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError as exc:
        return f"nothing answers on {host}:{port} ({exc.strerror or exc})"
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=3) as conn:
            conn.connect()
            props = conn.connection.server_properties
    except Exception as exc:
        return f"{host}:{port} answers but the connection failed: {exc!r}"
    product = _text(props.get("product", "amqp"))
    return Broker("amqp", url, f"{product} {_text(props.get('version', '?'))}")


def broker_leg(name: str, redis_url: str, redis_version: str, amqp_url: str) -> Broker | str:
    """The broker ``name`` (``redis``: the benchmark's own server at ``redis_url``; ``amqp``:
    RabbitMQ at ``amqp_url``), or why it cannot be used."""
    if name == "redis":
        return Broker("redis", redis_url, redis_version)
    return amqp_broker(amqp_url)


def broker_legs(
    names: Iterable[str],
    server: Any,
    amqp_url: str,
    skipped: Callable[[str], None] | None = None,
) -> Iterator[tuple[Broker, str]]:
    """Each usable broker of ``names`` (see :func:`broker_leg`) with the host line to print
    for it, the benchmark's Redis ``server`` holding the semaphores and results; a broker that
    cannot be used is skipped with a printed line (and ``skipped(name)``)."""
    version = server.version + (", embedded" if server.embedded else "")
    for name in names:
        broker = broker_leg(name, server.url, version, amqp_url)
        if isinstance(broker, str):
            print(f"\n[{name}] skipped: {broker}")
            if skipped is not None:
                skipped(name)
            continue
        yield broker, host_line(broker, version)


def isolated_app(name: str, url: str, broker_url: str, prefix: str, **settings: Any) -> Celery:
    """A benchmark's app whose run no other run sees: tasks go to the queue ``prefix`` and
    control messages to the exchange ``prefix``; results and records stay on the Redis server
    ``url`` under ``prefix`` (and the Redis broker's keys too). ``settings``: more of the app's
    settings."""
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=url,
        task_default_queue=prefix,
        control_exchange=prefix,
        result_backend_transport_options={"global_keyprefix": f"{prefix}:celery:"},
        broker_connection_retry_on_startup=True,
        redsem_key_prefix=prefix,
        worker_hijack_root_logger=False,
        **settings,
    )
    if not broker_url.startswith("amqp"):
        app.conf.broker_transport_options = {"global_keyprefix": f"{prefix}:kombu:"}
    return app


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def drop_queue(app: Celery, prefix: str) -> None:
    """Delete a RabbitMQ run's queue and exchanges (each named after ``prefix``)."""
    names = [("queue", prefix), ("exchange", prefix)]
    names += [("exchange", f"{prefix}.pidbox"), ("exchange", f"reply.{prefix}.pidbox")]
    for kind, name in names:
        with contextlib.suppress(Exception), app.connection_for_write() as conn:
            channel: Any = conn.default_channel
            if kind == "queue":
                channel.queue_delete(name)
            else:
                channel.exchange_delete(name)


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host_line(broker: Broker, server_version: str) -> str:
    """nproc, CPU model, the broker and the Redis server, and the versions that matter."""
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    python = ".".join(map(str, sys.version_info[:3]))
    return (
        f"host: nproc {nproc}, {cpu_model()}; broker {broker.name} ({broker.version}); "
        f"semaphores/results {server_version}; celery {celery.__version__}, python {python}"
    )
