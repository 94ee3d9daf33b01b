"""Tasks with ``dedupe="coalesce"`` and ``debounce`` (issue 42) on a plain ``Celery`` app that
nothing finalizes, set up from the environment as :mod:`.sender_tasks` is: a ``celery worker``
runs it (``-A tests.integration.apps.coalesce_tasks``), and a sender process only imports it.

Each body notes itself in ``<prefix>:c:bodies:<doc>`` (JSON: its version, the server time it
started, its process), and with ``hold=True`` waits for ``<prefix>:c:go:<doc>``, then takes
``seconds``; a version starting with ``fail`` then raises.
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from celery_redsem import with_lock, with_semaphore
from tests.integration.apps.tasks import app_settings, body_client

URL, PREFIX = os.environ["REDSEM_TEST_APP_URL"], os.environ["REDSEM_TEST_APP_PREFIX"]

app = Celery("coalescing", set_as_current=False)
app.conf.update(app_settings(URL, PREFIX))
#: ``c.rebuild_late`` goes to a queue of its own, which the worker-kill test's workers consume.
LATE_QUEUE = "coalesce-late"
app.conf.task_routes = {"c.rebuild_late": {"queue": LATE_QUEUE}}
app.conf.update(json.loads(os.environ.get("REDSEM_TEST_APP_CONF", "{}")))

#: This process's client of the test server.
counter = body_client(URL)


def bodies(doc: str) -> list[dict[str, object]]:
    """The bodies that ran for ``doc``, in the order they started."""
    return [json.loads(b) for b in counter().lrange(f"{PREFIX}:c:bodies:{doc}", 0, -1)]


def _body(doc: str, version: str, hold: bool, seconds: float = 0.0) -> str:
    now_s, now_us = counter().time()
    note = {"version": version, "at": now_s + now_us / 1e6, "pid": os.getpid()}
    counter().rpush(f"{PREFIX}:c:bodies:{doc}", json.dumps(note))
    if hold:
        counter().blpop([f"{PREFIX}:c:go:{doc}"], timeout=60)
    time.sleep(seconds)  # (a body that takes this long)
    if version.startswith("fail"):
        raise RuntimeError(f"failed {version}")
    return version


@app.task(name="c.rebuild")
@with_lock(key=lambda doc: f"rebuild:{doc}", dedupe="coalesce")
def rebuild(doc: str, version: str, hold: bool = False, seconds: float = 0.0) -> str:
    return _body(doc, version, hold, seconds)


@app.task(name="c.rebuild_late", acks_late=True)
@with_lock(key=lambda doc: f"late:{doc}", dedupe="coalesce")
def rebuild_late(doc: str, version: str, hold: bool = False) -> str:
    return _body(doc, version, hold)


@app.task(name="c.debounced")
@with_lock(key=lambda doc: f"debounced:{doc}", dedupe="coalesce", debounce=0.5)
def debounced(doc: str, version: str) -> str:
    return _body(doc, version, False)


@app.task(name="c.capped")
@with_semaphore(
    limit=2, key=lambda doc: f"capped:{doc}", dedupe="coalesce", debounce=0.3, debounce_max=0.6
)
def capped(doc: str, version: str) -> str:
    return _body(doc, version, False)


@app.task(name="c.echo")
def echo(value: str) -> str:
    return value
