"""The connection acquire and release go over: one kept per Redis client and process.

redis-py's client checks a connection out of its pool for every command and back in after it
(pool bookkeeping, observability hooks and a probe of the socket). Measured on a fast loopback
this is about a third of a call's client time, and acquire and release run on every task start
and end. So they go over a *lane*: a single-connection client (redis-py's own
``single_connection_client`` mode) on the caller's connection pool, kept as long as the client
lives and shared by every semaphore on that client in this process. Calls still go through
``Redis.execute_command``: its retries, health checks and any instrumentation that wraps it
(tracing, metrics) apply as before.

- One kept connection per client and process, never more: a thread that finds the lane busy
  sends its call through the client, as before, without waiting.
- The lane takes the connection its pool just got back from a call that worked, so it never
  opens one of its own, and a server that cannot be reached costs no extra attempt.
- A forked child never uses its parent's lane (the socket is shared with the parent).
- After :data:`PROBE_AFTER_IDLE` seconds unused, the socket is probed first, as the pool
  probes a connection it hands out: a server or proxy that closed an idle connection is
  noticed before the call, not by it.
- A call that fails on the lane with a connection error is sent once more through the client
  (acquire and release are idempotent per permit id). A timeout is not: the server may hang.
- Only a plain ``redis.Redis`` on a non-blocking ``ConnectionPool`` of at least
  :data:`MIN_POOL_FOR_LANE` connections, without client-side caching, gets a lane. Any other
  client (a subclass, ``RedisCluster``, a pipeline, a single-connection client, a
  ``BlockingConnectionPool``, a smaller pool) is used as it is.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

__all__ = ["MIN_POOL_FOR_LANE", "PROBE_AFTER_IDLE", "Lane", "executor_for", "lane_of"]

#: Seconds a lane may sit unused before its socket is probed ahead of the next call.
PROBE_AFTER_IDLE = 1.0
#: A pool capped below this many connections gets no lane: the lane keeps one connection for
#: good, which a small pool cannot spare. (redis-py's default cap is 100, or 2**31 before 8.0.)
MIN_POOL_FOR_LANE = 10

Executor = Callable[..., Any]


class Lane:
    """One kept connection of ``client``'s pool, for calls that run on every task start/end."""

    def __init__(self, client: redis.Redis) -> None:
        # Weak: the lanes are kept in a WeakKeyDictionary keyed by the client.
        self._client = weakref.ref(client)
        self.pool = client.connection_pool
        self._lock = threading.Lock()
        self.kept: redis.Redis | None = None  # the single-connection client, once set up
        self._used_at = 0.0

    def execute(self, *args: Any) -> Any:
        """Send one command (as ``execute_command``) over the lane, or through the client."""
        client = self._client()
        assert client is not None, "a lane outlived its client"  # callers hold the client
        if not self._lock.acquire(blocking=False):
            return client.execute_command(*args)  # type: ignore[no-untyped-call]
        try:
            kept = self.kept
            if kept is None:
                reply = client.execute_command(*args)  # type: ignore[no-untyped-call]
                self._keep()
                return reply
            now = time.monotonic()
            try:
                if now - self._used_at > PROBE_AFTER_IDLE:
                    _probe(kept)
                reply = kept.execute_command(*args)  # type: ignore[no-untyped-call]
            except ResponseError:  # the server's answer, read in full
                raise
            except RedisConnectionError:  # redis-py closed the connection
                reply = client.execute_command(*args)  # type: ignore[no-untyped-call]
            except BaseException:
                # Interrupted (a timeout, or an exception raised into the thread: a Celery
                # time limit, Ctrl-C) maybe between sending and reading: the reply may still
                # come, and the next call would read it as its own. Start afresh.
                _disconnect(kept)
                raise
            self._used_at = now
            return reply
        finally:
            self._lock.release()

    def _keep(self) -> None:
        """Take a connection of the pool for the lane (the one the last call gave back)."""
        try:
            self.kept = redis.Redis(connection_pool=self.pool, single_connection_client=True)
        except redis.RedisError:  # pool exhausted, server gone: the next call tries again
            return
        self._used_at = time.monotonic()

    def forget(self) -> None:
        """Drop the lane without touching its socket (in a forked child: it is the parent's)."""
        self._lock = threading.Lock()  # a lock held at the fork stays held in the child
        self.kept = None


def _probe(kept: redis.Redis) -> None:
    """Close the kept connection if its socket is readable while no reply is due (data a lost
    call never read): the next command opens a new one. Raise ConnectionError, the
    connection closed, if the server closed it."""
    connection = kept.connection
    if connection is None:
        return
    try:
        stale = connection.can_read()
    except RedisConnectionError:  # it read the server's close
        _disconnect(kept)
        raise
    if stale:
        _disconnect(kept)


def _disconnect(kept: redis.Redis) -> None:
    if kept.connection is not None:
        kept.connection.disconnect()  # type: ignore[no-untyped-call]


_lanes: weakref.WeakKeyDictionary[redis.Redis, Lane] = weakref.WeakKeyDictionary()
_lanes_lock = threading.Lock()


def executor_for(client: Any) -> Executor:
    """What to send acquire and release through: ``client``'s lane if it can have one, else
    its own ``execute_command``."""
    if not _lane_suits(client):
        return client.execute_command  # type: ignore[no-any-return]
    with _lanes_lock:
        lane = _lanes.get(client)
        if lane is None:
            lane = _lanes[client] = Lane(client)
    return lane.execute


def lane_of(client: Any) -> Lane | None:
    """``client``'s lane in this process, if a semaphore made one (for inspection)."""
    try:
        return _lanes.get(client)
    except TypeError:  # not weakly referable: it has none
        return None


def _lane_suits(client: Any) -> bool:
    if type(client) is not redis.Redis or client.connection is not None:
        return False
    pool = client.connection_pool
    return (
        isinstance(pool, redis.ConnectionPool)
        and not isinstance(pool, redis.BlockingConnectionPool)
        and getattr(pool, "cache", None) is None
        and getattr(pool, "max_connections", 0) >= MIN_POOL_FOR_LANE
    )


def _forget_all_in_child() -> None:
    for lane in list(_lanes.values()):
        lane.forget()


os.register_at_fork(after_in_child=_forget_all_in_child)
