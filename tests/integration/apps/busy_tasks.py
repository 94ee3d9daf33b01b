"""Tasks for ``on_busy``, ``dedupe`` and per-key limits (issue 21), on an app of their own.

Each body counts itself with an independent counter in Redis, as tests/integration/apps/tasks.py
does:
``<prefix>:b:runs:<key>`` (bodies run), ``<prefix>:b:cur:<key>`` / ``<prefix>:b:max:<key>``
(running now / most at once), ``<prefix>:b:pid:<key>`` (the process of the last body to start).
A body given ``hold=True`` waits for ``<prefix>:b:go:<key>``. Every
:data:`~celery_redsem.signals.task_skipped` of the app's tasks, in whatever process, is noted
in ``<prefix>:b:skipped:<task id>`` (its reason).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_redsem import with_lock, with_semaphore
from celery_redsem.signals import task_skipped
from tests.integration.apps.tasks import body_client, make_app

_ENTER = """
local c = redis.call('INCR', KEYS[1])
if c > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], c) end
redis.call('INCR', KEYS[3])
return c
"""


def make_busy_app(redis_url: str, prefix: str, **conf: Any) -> Celery:
    """The test app of tests/integration/apps/tasks.py with the tasks of this module added."""
    app = make_app(redis_url, prefix, **conf)
    counter = body_client(redis_url)

    def body(key: str, hold: bool = False, seconds: float = 0.0) -> str:
        keys = [f"{prefix}:b:{what}:{key}" for what in ("cur", "max", "runs")]
        counter().eval(_ENTER, 3, *keys)
        counter().set(f"{prefix}:b:pid:{key}", os.getpid())
        try:
            if hold:
                counter().blpop([f"{prefix}:b:go:{key}"], timeout=30)
            time.sleep(seconds)
        finally:
            counter().decr(keys[0])
        return "ran"

    @app.task(shared=False, name="b.skip")
    @with_lock(key=lambda key: f"skip:{key}", on_busy="skip")
    def skip(key: str, hold: bool = False) -> str:
        return body(key, hold)

    @app.task(shared=False, name="b.fail")
    @with_lock(key=lambda key: f"skip:{key}", on_busy="fail")
    def fail(key: str) -> str:
        return body(key)

    @app.task(shared=False, bind=True, name="b.once")
    @with_lock(key=lambda key: f"once:{key}", dedupe=True)
    def once(
        self: Any, key: str, hold: bool = False, seconds: float = 0.0, boom: bool = False
    ) -> str:
        if boom:
            raise RuntimeError("boom")
        return body(key, hold, seconds)

    @app.task(shared=False, name="b.once_raise")
    @with_lock(key=lambda key: f"once:{key}", dedupe="raise")
    def once_raise(key: str, hold: bool = False) -> str:
        return body(key, hold)

    @app.task(shared=False, name="b.plan")
    @with_semaphore(
        limit=lambda account: 2 if account == "small" else 4,
        key=lambda account: f"plan:{account}",
    )
    def plan(account: str, seconds: float = 0.3) -> str:
        return body(account, seconds=seconds)

    def note_skip(sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
        if getattr(sender, "app", None) is app:
            counter().rpush(f"{prefix}:b:skipped:{task_id}", kwargs["reason"])

    task_skipped.connect(note_skip, weak=False, dispatch_uid=f"b:{id(app)}")
    return app


def close_busy_app(app: Celery) -> None:
    """Disconnect what :func:`make_busy_app` connected, then close the app."""
    from tests.integration.conftest import (
        close_app,
    )  # (not in a worker subprocess: it needs pytest)

    task_skipped.disconnect(dispatch_uid=f"b:{id(app)}")
    close_app(app)
