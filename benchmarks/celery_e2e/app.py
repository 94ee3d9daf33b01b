"""The workers' Celery app: the task variants the benchmark runs, and what the bodies record.

:func:`make_app` builds it (the driver builds one too, to send tasks); a worker builds its own
from the environment the harness gives it, in :func:`worker_app` (see
:mod:`benchmarks.celery_e2e.worker`). Importing this module changes nothing: no app is built,
no signal connected.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from celery.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    task_received,
    worker_shutdown,
)

from benchmarks._brokers import isolated_app
from celery_redsem import FairSemaphore, Permit, contention_retries, get_client, with_semaphore

ENV_URL, ENV_BROKER, ENV_PREFIX, ENV_LIMIT, ENV_TAG = (
    "REDSEM_BENCH_APP_URL",
    "REDSEM_BENCH_BROKER_URL",
    "REDSEM_BENCH_APP_PREFIX",
    "REDSEM_BENCH_LIMIT",
    "REDSEM_BENCH_TAG",
)
ENV_NAIVE_COUNTDOWN = "REDSEM_BENCH_NAIVE_COUNTDOWN"
ENV_SETTINGS = "REDSEM_BENCH_SETTINGS"
ENV_STAMPS = "REDSEM_BENCH_STAMPS"
RECORD_CONNECTIONS = 1000  # the bodies' record client's pool, per worker process

# A body counts itself in (an over-admission if over the limit) and records its start, in one
# round trip: the stop scenarios' ledger (:mod:`benchmarks.celery_e2e.ledger`) needs the bodies
# that began and never ended.
_ENTER = """
local c = redis.call('INCR', KEYS[1])
if c > tonumber(ARGV[1]) then redis.call('INCR', KEYS[2]) end
redis.call('RPUSH', KEYS[3], ARGV[2])
return c
"""


def make_app(
    url: str,
    prefix: str,
    limit: int,
    naive_countdown: float,
    settings: dict[str, Any] | None = None,
    broker_url: str | None = None,
) -> Celery:
    """The benchmark app: the task variants, results and records under ``prefix``.

    The broker is ``broker_url`` (default: ``url``); tasks go to the queue ``prefix`` and
    control messages to the exchange ``prefix.pidbox``, so no other run sees them.
    """
    broker_url = broker_url or url
    app = isolated_app(
        "redsembench", url, broker_url, prefix, redsem_lease=5.0, task_ignore_result=True
    )
    app.conf.update(settings or {})
    clients: dict[int, redis.Redis] = {}

    def client() -> redis.Redis:  # (one per process: a forked pool child makes its own)
        pid = os.getpid()
        if pid not in clients:
            # The bodies' records: one connection per body at once, and a green worker -c 200
            # runs 200 (redis-py 8 pools hold 100: "Too many connections" failed plain bodies).
            clients[pid] = redis.Redis.from_url(url, max_connections=RECORD_CONNECTIONS)
        return clients[pid]

    def body(mode: str, tag: str, key: str, sent: float, seconds: float, request: Any) -> None:
        start = time.time()
        counter = f"{prefix}:b:{tag}:cur:{key}"
        started = {"id": request.id, "start": start, "pid": os.getpid()}
        keys = (counter, f"{prefix}:b:{tag}:over", f"{prefix}:b:{tag}:started")
        client().eval(_ENTER, 3, *keys, limit, json.dumps(started))
        time.sleep(seconds)
        client().decr(counter)
        end = time.time()
        retries = contention_retries(request) if mode == "fair" else request.retries
        record = {
            "key": key,
            "sent": sent,
            "start": start,
            "end": end,
            "retries": retries,
            "pid": os.getpid(),
            "worker": request.hostname,
            "id": request.id,
        }
        record.update(child_stamps.take(request.id))
        client().rpush(f"{prefix}:b:{tag}:done", json.dumps(record))

    @app.task(shared=False, bind=True, name="bench.fair")
    @with_semaphore(limit=limit, key=lambda key: f"fair:{key}")
    def fair(self: Any, key: str, sent: float, seconds: float, tag: str = "fair") -> None:
        body("fair", tag, key, sent, seconds, self.request)

    @app.task(shared=False, bind=True, name="bench.fair_late", acks_late=True)
    @with_semaphore(limit=limit, key=lambda key: f"fair:{key}")
    def fair_late(self: Any, key: str, sent: float, seconds: float, tag: str = "fair") -> None:
        body("fair", tag, key, sent, seconds, self.request)

    @app.task(shared=False, name="bench.warm")
    @with_semaphore(limit=1, key=lambda i: f"warm:{i}")
    def warm(i: int, seconds: float, tag: str = "") -> None:
        time.sleep(seconds)
        client().incr(f"{prefix}:b:{tag}:warm")

    @app.task(shared=False, bind=True, name="bench.plain")
    def plain(self: Any, key: str, sent: float, seconds: float, tag: str = "plain") -> None:
        body("plain", tag, key, sent, seconds, self.request)

    @app.task(shared=False, bind=True, name="bench.naive", max_retries=None)
    def naive(self: Any, key: str, sent: float, seconds: float, tag: str = "naive") -> None:
        sem = FairSemaphore(get_client(app), f"naive:{key}", limit, lease=5.0, prefix=prefix)
        permit = sem.attempt(self.request.id)  # no waiting line
        if not isinstance(permit, Permit):
            raise self.retry(countdown=naive_countdown)
        try:
            body("naive", tag, key, sent, seconds, self.request)
        finally:
            sem.release(permit)

    return app


class ChildStamps:
    """In a pool child, with :data:`ENV_STAMPS` set (``--dump``): when Celery began each task
    (``task_prerun``) and finished the one before (``task_postrun``), for the next record.

    A record is pushed from inside its body, before its own ``task_postrun``; so each record
    carries the previous run's ``postrun`` in this process (``prev``, with its id): no extra
    round trip, and nothing else on the task's path but two signal receivers.
    """

    def __init__(self) -> None:
        self.prerun: dict[str, float] = {}
        self.postrun: tuple[str, float] | None = None

    def connect(self) -> None:
        task_prerun.connect(self._on_prerun, weak=False, dispatch_uid=f"{__name__}.prerun")
        task_postrun.connect(self._on_postrun, weak=False, dispatch_uid=f"{__name__}.postrun")

    def _on_prerun(self, task_id: str = "", **_: Any) -> None:
        self.prerun[task_id] = time.time()

    def _on_postrun(self, task_id: str = "", **_: Any) -> None:
        self.postrun = (task_id, time.time())

    def take(self, task_id: str) -> dict[str, Any]:
        """The stamps to add to ``task_id``'s record (none unless connected)."""
        stamps: dict[str, Any] = {}
        prerun = self.prerun.pop(task_id, None)
        if prerun is not None:
            stamps["prerun"] = prerun
        if self.postrun is not None:
            stamps["prev"] = list(self.postrun)
            self.postrun = None
        return stamps


child_stamps = ChildStamps()


def record_failures(url: str, prefix: str) -> None:
    """In a worker: push every failed task's id and error to ``prefix:b:failed`` (a task that
    never ran, with a failure recorded, is no silent loss)."""

    @task_failure.connect(weak=False)
    def _failed(task_id: str = "", exception: BaseException | None = None, **_: Any) -> None:
        client = redis.Redis.from_url(url)
        try:
            client.rpush(
                f"{prefix}:b:failed", json.dumps({"id": task_id, "error": repr(exception)})
            )
        finally:
            client.close()


def count_deliveries(url: str, prefix: str, tag: str) -> None:
    """In a worker: count the measured tasks it receives, by batch; add the counts up at
    shutdown, and count the worker (tagged ``tag``) as flushed.

    A measured task's id is ``<batch tag>.<n>``
    (:func:`~benchmarks.celery_e2e.harness.send_batch`): counted in memory by that tag (nothing
    on the dispatch path but a dict update) and written once, to
    ``prefix:b:<batch tag>:received``, when the worker stops.
    """
    received: Counter[str] = Counter()

    @task_received.connect(weak=False)
    def _received(request: Any = None, **_: Any) -> None:
        if getattr(request, "name", "") != "bench.warm":
            received[str(getattr(request, "id", "")).rpartition(".")[0]] += 1

    @worker_shutdown.connect(weak=False)
    def _flush(**_: Any) -> None:
        client = redis.Redis.from_url(url)
        try:
            pipe = client.pipeline()
            for batch, count in received.items():
                pipe.incrby(f"{prefix}:b:{batch}:received", count)
            pipe.incr(f"{prefix}:b:{tag}:flushed")
            pipe.execute()
        finally:
            client.close()


@dataclass(frozen=True)
class WorkerConfig:
    """What a set of workers builds its app from; the harness passes it in their environment
    (:meth:`environ`), and each worker reads it back in :func:`worker_app`."""

    url: str  # results, semaphores and records
    broker_url: str
    prefix: str
    limit: int
    tag: str  # the worker set's tag (its workers count themselves flushed under it)
    naive_countdown: float = 0.1
    settings: dict[str, Any] = field(default_factory=dict)  # redsem_* settings
    stamps: bool = False  # child stamps on every record (``--dump``)

    def environ(self) -> dict[str, str]:
        """The environment variables that carry this configuration to a worker."""
        return {
            ENV_URL: self.url,
            ENV_BROKER: self.broker_url,
            ENV_PREFIX: self.prefix,
            ENV_LIMIT: str(self.limit),
            ENV_TAG: self.tag,
            ENV_NAIVE_COUNTDOWN: str(self.naive_countdown),
            ENV_SETTINGS: json.dumps(self.settings),
            ENV_STAMPS: "1" if self.stamps else "",
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> WorkerConfig:
        """The configuration :meth:`environ` wrote (KeyError if the URL, prefix or limit is
        missing: not a worker of this benchmark)."""
        return cls(
            url=environ[ENV_URL],
            broker_url=environ.get(ENV_BROKER) or environ[ENV_URL],
            prefix=environ[ENV_PREFIX],
            limit=int(environ[ENV_LIMIT]),
            tag=environ.get(ENV_TAG, "-"),
            naive_countdown=float(environ.get(ENV_NAIVE_COUNTDOWN, "0.1")),
            settings=json.loads(environ.get(ENV_SETTINGS, "{}")),
            stamps=bool(environ.get(ENV_STAMPS)),
        )


def worker_app(environ: Mapping[str, str] | None = None) -> Celery:
    """A worker's app, built from ``environ`` (default: this process's environment): the
    tasks, the delivery count flushed at shutdown, and the child stamps if asked for."""
    config = WorkerConfig.from_environ(os.environ if environ is None else environ)
    app = make_app(
        config.url,
        config.prefix,
        config.limit,
        config.naive_countdown,
        config.settings,
        config.broker_url,
    )
    count_deliveries(config.url, config.prefix, config.tag)
    record_failures(config.url, config.prefix)
    if config.stamps:
        child_stamps.connect()
    return app
