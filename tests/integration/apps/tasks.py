"""The test tasks, registered on a fresh app by :func:`make_app` (for every kind of worker).

Task bodies count themselves in and out with a Lua script on their own Redis connection, so the
tests check the semaphore against an independent counter: ``<prefix>:t:cur:<key>`` (running now),
``<prefix>:t:max:<key>`` (most at once), ``<prefix>:t:log:<key>`` (start/end events in order)
and ``<prefix>:t:log:<key>:at`` (each start's time on the server's clock).
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded

from celery_redsem import (
    FairSemaphore,
    PermitLost,
    current_permit,
    read_state,
    with_lock,
    with_semaphore,
)
from celery_redsem.integration.wire import WAIT_HEADER

#: Socket timeout of the bodies' own Redis client: above the longest BLPOP they wait on for the
#: test's go (redis-py 8 would give them 5 s, and a loaded host can keep a body waiting longer).
BODY_WAIT_TIMEOUT = 60.0

_ENTER = """
local c = redis.call('INCR', KEYS[1])
if c > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], c) end
redis.call('RPUSH', KEYS[3], 'start ' .. ARGV[1])
local t = redis.call('TIME')
redis.call('RPUSH', KEYS[4], t[1] .. '.' .. string.format('%06d', t[2]))
return c
"""
_EXIT = """
redis.call('DECR', KEYS[1])
redis.call('RPUSH', KEYS[3], 'end ' .. ARGV[1])
return 1
"""


def body_client(redis_url: str) -> Callable[[], redis.Redis]:
    """The bodies' own client of ``redis_url``: one per process (a forked pool child makes its
    own), waiting as long as a body may wait for the test's go."""
    clients: dict[int, redis.Redis] = {}

    def client() -> redis.Redis:
        pid = os.getpid()
        if pid not in clients:
            clients[pid] = redis.Redis.from_url(redis_url, socket_timeout=BODY_WAIT_TIMEOUT)
        return clients[pid]

    return client


def bad_key(mode: str) -> object:
    """A key function that misbehaves on demand."""
    if mode == "raise":
        raise RuntimeError("key function exploded")
    if mode == "exit":
        raise SystemExit(3)  # in the worker's main process (admission) it must not stop it
    if mode == "interrupt":
        raise KeyboardInterrupt
    return {"none": None, "int": 5, "huge": "x" * 10_000, "braces": "a{b}", "good": "fine"}[mode]


def app_settings(redis_url: str, prefix: str) -> dict[str, Any]:
    """A test app's broker, results and semaphores, all on ``redis_url`` under ``prefix``."""
    return {
        "broker_url": redis_url,
        "result_backend": redis_url,
        "broker_transport_options": {"global_keyprefix": f"{prefix}:kombu:"},
        "result_backend_transport_options": {"global_keyprefix": f"{prefix}:celery:"},
        "broker_connection_retry_on_startup": True,
        "redsem_key_prefix": prefix,
        "worker_hijack_root_logger": False,
    }


def make_app(redis_url: str, prefix: str, **conf: Any) -> Celery:
    """An app on ``redis_url`` whose broker, results and semaphores all live under ``prefix``."""
    app = Celery("redsemtest", set_as_current=False)
    app.conf.update(
        app_settings(redis_url, prefix),
        redsem_lease=1.0,
        redsem_retry_backoff=0.05,
        redsem_retry_backoff_max=0.5,
        task_track_started=True,
    )
    app.conf.update(conf)
    counter = body_client(redis_url)

    def keys(key: str) -> list[str]:
        log = f"{prefix}:t:log:{key}"
        return [f"{prefix}:t:cur:{key}", f"{prefix}:t:max:{key}", log, f"{log}:at"]

    def enter(key: str, task_id: str) -> None:
        counter().eval(_ENTER, 4, *keys(key), task_id)

    def leave(key: str, task_id: str) -> None:
        counter().eval(_EXIT, 3, *keys(key)[:3], task_id)

    def counted_body(key: str, task_id: str, seconds: float) -> None:
        enter(key, task_id)
        try:
            time.sleep(seconds)
        finally:
            leave(key, task_id)

    def describe(request: Any) -> dict[str, Any]:
        held = current_permit()
        assert held is not None
        wait = (request.headers or {}).get(WAIT_HEADER) or [0, 0, 0, 0, 0, 0]
        return {
            "retries": request.retries,
            "contention_retries": wait[0],
            "redis_errors": wait[3] if len(wait) > 3 else 0,
            "token": held.token,
            "name": held.name,
            "lost": held.lost,
            "same_as_request": getattr(request, "redsem_permit", None) is held,
        }

    @app.task(shared=False, bind=True, name="t.counted", max_retries=0)
    @with_semaphore(limit=3, key=lambda key: f"counted:{key}")
    def counted(self: Any, key: str, seconds: float = 0.1) -> dict[str, Any]:
        counted_body(key, self.request.id, seconds)
        return describe(self.request)

    @app.task(shared=False, name="t.locked", max_retries=0)
    @with_lock(key=lambda key: f"locked:{key}")
    def locked(key: str, seconds: float = 0.0) -> dict[str, Any]:
        request = locked.request
        counted_body(key, request.id or "direct", seconds)
        return describe(request)

    @app.task(shared=False, bind=True, name="t.nested", max_retries=0)
    @with_semaphore(limit=5, key=lambda key: f"nested-outer:{key}")
    @with_lock(key=lambda key: f"nested:{key}")
    def nested(self: Any, key: str, how: str) -> dict[str, Any]:
        """Makes a guarded call on a key it holds, from its body (``how``, see the tests)."""
        inner: Any = None
        if how == "itself":
            inner = self(key, "inner")
        elif how == "delay":  # runs inline in eager mode
            inner = [t.delay(key).get(disable_sync_subtasks=False) for t in (locked_too, outer_too)]
        elif how == "lost":  # its lock is taken away first
            held = current_permit()
            assert held is not None
            read = FairSemaphore(counter(), held.name, 1, prefix=prefix)
            assert read.release(held.id)
            deadline = time.monotonic() + 10
            while not held.lost and time.monotonic() < deadline:
                time.sleep(0.02)
            try:
                self(key, "inner")
            except PermitLost as exc:
                inner = type(exc).__name__
        elif how == "other_limit":  # the outer key, locked (limit 1 instead of 5)
            try:
                inner = outer_locked.apply(args=(key,)).get(disable_sync_subtasks=False)
            except Exception as exc:
                inner = type(exc).__name__
        elif how == "thread":  # a copy of this context, in another thread
            outcome: list[str] = []

            def call() -> None:
                try:
                    outcome.append(locked_too.apply(args=(key,)).get(disable_sync_subtasks=False))
                except Exception as exc:
                    outcome.append(type(exc).__name__)

            thread = threading.Thread(target=contextvars.copy_context().run, args=(call,))
            thread.start()
            thread.join(30)
            inner = outcome
        state = read_state(counter(), f"nested:{key}", prefix=prefix)
        return {
            "id": self.request.id,
            "inner": inner,
            "holders": [h.permit_id for h in state.holders],
        }

    @app.task(shared=False, name="t.locked_too", max_retries=0)
    @with_lock(key=lambda key: f"nested:{key}")
    def locked_too(key: str) -> str:
        return "ran"

    @app.task(shared=False, name="t.outer_too", max_retries=0)
    @with_semaphore(limit=5, key=lambda key: f"nested-outer:{key}")
    def outer_too(key: str) -> str:
        return "ran too"

    @app.task(shared=False, name="t.outer_locked", max_retries=0)
    @with_lock(key=lambda key: f"nested-outer:{key}")
    def outer_locked(key: str) -> str:
        return "ran locked"

    @app.task(shared=False, bind=True, name="t.two_guards", max_retries=0)
    @with_semaphore(limit=2, key=lambda key: f"outer:{key}")
    @with_lock(key=lambda key: f"inner:{key}")
    def two_guards(self: Any, key: str) -> dict[str, Any]:
        """Holds a permit of two semaphores at once; reports who holds each."""
        holders = {
            which: [h.permit_id for h in read_state(counter(), name, prefix=prefix).holders]
            for which, name in (("outer", f"outer:{key}"), ("inner", f"inner:{key}"))
        }
        return {"id": self.request.id, **holders, **describe(self.request)}

    @app.task(shared=False, bind=True, name="t.until_killed")
    @with_lock(key=lambda key: f"killed:{key}", lease=10.0)
    def until_killed(self: Any, key: str, retry_first: bool = False) -> str:
        if retry_first and not self.request.retries:
            raise self.retry(countdown=0)  # the killed run is the retried one
        counter().set(f"{prefix}:t:pid:{key}", os.getpid())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return "survived"

    @app.task(shared=False, bind=True, name="t.until_killed_short_lease")
    @with_lock(key=lambda key: f"killed:{key}")  # the app's 1 s lease
    def until_killed_short_lease(self: Any, key: str) -> str:
        counter().set(f"{prefix}:t:pid:{key}", os.getpid())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return "survived"

    @app.task(shared=False, bind=True, name="t.autoretry_killed", autoretry_for=(ValueError,))
    @with_lock(key=lambda key: f"auto:{key}", lease=10.0)
    def autoretry_killed(self: Any, key: str) -> str:
        counter().set(f"{prefix}:t:pid:{key}", os.getpid())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return "survived"

    @app.task(shared=False, bind=True, name="t.ignores_exit")
    @with_lock(key=lambda key: f"stubborn:{key}", lease=10.0)
    def ignores_exit(self: Any, key: str) -> str:
        """Swallows the SystemExit a SIGTERM raises in a pool child: only SIGKILL ends it, so
        only the worker's main process can free its permit before the lease runs out."""
        deadline = time.monotonic() + 60
        noted = False
        while time.monotonic() < deadline:
            try:
                if not noted:  # (in the try: the test may signal before the reply is read)
                    counter().set(f"{prefix}:t:pid:{key}", os.getpid())
                    noted = True
                time.sleep(0.05)
            except SystemExit:
                counter().set(f"{prefix}:t:ignored:{key}", 1)
        return "survived"

    @app.task(shared=False, bind=True, name="t.survives_signal")
    @with_lock(key=lambda key: f"survivor:{key}", lease=10.0)
    def survives_signal(self: Any, key: str) -> str:
        """Catches the soft time limit that SIGUSR1 raises, then cleans up for a while."""
        try:
            # Inside the try: the test signals once it sees the pid, which may be before this
            # call has read its reply (a busy host), and the signal must land in the try.
            counter().set(f"{prefix}:t:pid:{key}", os.getpid())
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.05)
        except SoftTimeLimitExceeded:
            counter().set(f"{prefix}:t:cleaning:{key}", 1)
            # The body's own slow cleanup, until the test lets it end: it still holds the lock.
            counter().blpop([f"{prefix}:t:cleaned:{key}"], timeout=20)
            counter().delete(f"{prefix}:t:cleaning:{key}")
        return "cleaned up"

    @app.task(shared=False, bind=True, name="t.hard_limit", time_limit=1)
    @with_lock(key=lambda key: f"hard:{key}", lease=10.0)
    def hard_limit(self: Any, key: str) -> str:
        counter().set(f"{prefix}:t:pid:{key}", os.getpid())
        time.sleep(30)
        return "survived"

    @app.task(shared=False, bind=True, name="t.soft_limit", soft_time_limit=0.5)
    @with_lock(key=lambda key: f"soft:{key}")
    def soft_limit(self: Any, key: str) -> str:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return "survived"

    def work_until_interrupted(key: str) -> None:
        """Note the process, then work in small steps for 30 s (unless interrupted)."""
        counter().set(f"{prefix}:t:pid:{key}", os.getpid())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.02)

    @app.task(shared=False, bind=True, name="t.lost_raises")
    @with_lock(key=lambda key: f"lost:{key}", lost_lease_policy="raise")
    def lost_raises(self: Any, key: str) -> str:
        work_until_interrupted(key)
        return "not interrupted"

    @app.task(shared=False, bind=True, name="t.lost_swallowed")
    @with_lock(key=lambda key: f"lost:{key}", lost_lease_policy="raise")
    def lost_swallowed(self: Any, key: str) -> str:
        try:
            work_until_interrupted(key)
        except Exception:  # a broad handler in the body takes the interrupt too
            return "swallowed"
        return "not interrupted"

    def held_until_go(key: str) -> str:
        counter().set(f"{prefix}:t:pid:{key}", os.getpid())
        counter().blpop([f"{prefix}:t:go:{key}"], timeout=20)
        return "done"

    # A lease longer than the test: no refresh runs while the body waits for its go.
    @app.task(shared=False, name="t.held_long")
    @with_lock(key=lambda key: f"long:{key}", lease=30.0)
    def held_long(key: str) -> str:
        return held_until_go(key)

    @app.task(shared=False, name="t.held_long_raises")
    @with_lock(key=lambda key: f"long:{key}", lease=30.0, lost_lease_policy="raise")
    def held_long_raises(key: str) -> str:
        return held_until_go(key)

    @app.task(shared=False, bind=True, name="t.retries_inside", max_retries=1)
    @with_lock(key=lambda key: f"again:{key}")
    def retries_inside(self: Any, key: str) -> dict[str, Any]:
        """Publishes its own retry, then holds on until the test pushes to ``t:go:<key>``."""
        enter(key, self.request.id)
        try:
            if self.request.retries == 0:
                retry = self.retry(countdown=0, throw=False)  # the next run is queued now
                counter().blpop([f"{prefix}:t:go:{key}"], timeout=20)
                raise retry
        finally:
            leave(key, self.request.id)
        held = current_permit()
        assert held is not None
        return {"retries": self.request.retries, "permit_id": held.id}

    @app.task(shared=False, bind=True, name="t.replaced", max_retries=0)
    @with_lock(key=lambda key: f"replaced:{key}")
    def replaced(self: Any, key: str) -> dict[str, Any]:
        if not self.request.replaced_task_nesting:
            raise self.replace(self.s(key))  # queued under the same task id
        held = current_permit()
        assert held is not None
        return {"nesting": self.request.replaced_task_nesting, "permit_id": held.id}

    @app.task(shared=False, bind=True, name="t.ways_out", max_retries=1)
    @with_lock(key=lambda key: f"ways:{key}")
    def ways_out(self: Any, key: str, how: str) -> str:
        if how == "raise":
            raise ValueError("body failed")
        if how == "retry" and self.request.retries == 0:
            raise self.retry(countdown=0.05)
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("rejected", requeue=False)
        return f"{how}:{self.request.retries}"

    @app.task(shared=False, name="t.bad_key")
    @with_semaphore(limit=2, key=bad_key)
    def bad_key_task(mode: str) -> str:
        return "ran"

    def slow_key(key: str) -> str:
        counter().rpush(f"{prefix}:t:keypids:{key}", os.getpid())  # which process ran it
        time.sleep(0.1)  # a database lookup, say: over admission's SLOW_KEY_FUNCTION
        return f"slowkey:{key}"

    @app.task(shared=False, bind=True, name="t.slow_key", max_retries=0)
    @with_lock(key=slow_key)
    def slow_key_task(self: Any, key: str) -> dict[str, Any]:
        return describe(self.request)

    first_calls: set[str] = set()  # (keys whose key function ran in this process)

    def slow_at_first(key: str) -> str:
        if key not in first_calls:  # a cache to fill, a database to reach: once per process
            first_calls.add(key)
            counter().rpush(f"{prefix}:t:keypids:{key}", os.getpid())
            time.sleep(3.0)
        return f"slowfirst:{key}"

    @app.task(shared=False, name="t.slow_first", max_retries=0)
    @with_lock(key=slow_at_first)
    def slow_first(key: str) -> str:
        return "ran"

    @app.task(shared=False, name="t.plain", max_retries=0)
    def plain(key: str) -> str:
        return key

    @app.task(shared=False, name="t.budget")
    @with_lock(key=lambda key: f"budget:{key}", max_wait=0.5)
    def budget(key: str) -> str:
        return "ran"

    # A lease of 2 s and a body that computes without yielding (no I/O, no sleep) for longer.
    @app.task(shared=False, bind=True, name="t.spin", max_retries=0)
    @with_lock(key=lambda key: f"spin:{key}", lease=2.0)
    def spin(self: Any, key: str, seconds: float) -> dict[str, Any]:
        counter().set(f"{prefix}:t:pid:{key}", os.getpid())
        deadline = time.monotonic() + seconds
        steps = 0
        while time.monotonic() < deadline:
            steps += 1
        return {"steps": steps, **describe(self.request)}

    @app.task(shared=False, bind=True, name="t.fifo")
    @with_lock(key=lambda key, tag: f"fifo:{key}")
    def fifo(self: Any, key: str, tag: str, seconds: float = 0.0) -> dict[str, Any]:
        """Holds ``seconds``; a negative ``seconds``: until the test pushes to ``t:go:<key>``."""
        counter().rpush(f"{prefix}:t:order:{key}", tag)
        if seconds < 0:
            counter().blpop([f"{prefix}:t:go:{key}"], timeout=20)
        else:
            time.sleep(seconds)
        return {"tag": tag, **describe(self.request)}

    return app
