"""The connection acquire and release go over: one kept per connection pool and process.

redis-py's client checks a connection out of its pool for every command and back in after it
(pool bookkeeping, observability hooks and a probe of the socket). Measured on a fast loopback
this is about a third of a call's client time, and acquire and release run on every task start
and end. So they go over a *lane*: a single-connection client (redis-py's own
``single_connection_client`` mode) on the caller's connection pool, kept while any client on
that pool lives and shared by every semaphore on those clients in this process. Calls still go
through ``Redis.execute_command``: the connection's retry policy, health checks and any
instrumentation that wraps the method (tracing, metrics) apply as before.

- One kept connection per pool and process, never more: a thread that finds the lane busy
  sends its call through the pool, as before, without waiting.
- The lane takes the connection its pool just got back from a call that worked, so setting
  it up never opens a connection.
- A forked child never uses its parent's lane (the socket is shared with the parent).
- Before a call the connection is readied as the pool readies one it hands out: opened with
  ``connect()`` if closed (where a Sentinel-managed connection looks up the primary), and
  after :data:`PROBE_AFTER_IDLE` seconds unused, probed first: a server or proxy that closed
  an idle connection is noticed before the call, not by it.
- A connection error on the lane is handled as on the pool: by the connection's retry policy
  (redis-py reconnects and sends again, if it retries at all). The lane adds no retry.
- A call interrupted by anything but the server's answer (a timeout, or an exception raised
  into the thread: a Celery time limit, Ctrl-C) closes the connection: a reply still on its
  way must not be read by the next call.
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

from celery_redsem.core.connections import is_open

__all__ = ["MIN_POOL_FOR_LANE", "PROBE_AFTER_IDLE", "Lane", "executor_for", "lane_of"]

#: Seconds a lane may sit unused before its socket is probed ahead of the next call.
PROBE_AFTER_IDLE = 1.0
#: A pool capped below this many connections gets no lane: the lane keeps one connection for
#: good, which a small pool cannot spare. (redis-py's default cap is 100, or 2**31 before 8.0.)
MIN_POOL_FOR_LANE = 10

Executor = Callable[..., Any]


class Lane:
    """One kept connection of ``pool``, for the calls that run on every task start and end."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        # For calls that do not use the lane. Only plain redis.Redis clients get a lane, so
        # this one does what theirs would.
        self._pooled = redis.Redis(connection_pool=pool)
        self._lock = threading.Lock()
        self.kept: redis.Redis | None = None  # the single-connection client, once set up
        self._used_at = 0.0

    def execute(self, *args: Any) -> Any:
        """Send one command (as ``execute_command``) over the lane, or through the pool."""
        if not self._lock.acquire(blocking=False):
            return self._pooled.execute_command(*args)  # type: ignore[no-untyped-call]
        try:
            kept = self.kept
            if kept is None:
                reply = self._pooled.execute_command(*args)  # type: ignore[no-untyped-call]
                self._keep()
                return reply
            now = time.monotonic()
            try:
                _check_out(kept, idle=now - self._used_at > PROBE_AFTER_IDLE)
                reply = kept.execute_command(*args)  # type: ignore[no-untyped-call]
            except ResponseError:  # the server's answer, read in full
                raise
            except BaseException:
                # Maybe between sending and reading: the reply may still come, and the next
                # call would read it as its own. (A connection error closed it already.)
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


def _check_out(kept: redis.Redis, *, idle: bool) -> None:
    """Make the kept connection ready for a call, as the pool readies one it hands out.

    After ``idle``, an open socket that is readable while no reply is due (the server closed
    it, or a lost call left data unread) is closed first. A closed one is opened with
    ``connect()``, under the connection's retry policy: a Sentinel-managed connection asks
    the Sentinels for the primary there, and only there (redis-py opens a connection that
    a command finds closed at the address it had).
    """
    connection = kept.connection
    if connection is None:
        return
    if idle and is_open(connection):
        try:
            stale = connection.can_read()
        except RedisConnectionError:  # it read the server's close (and closed its end)
            stale = True
        if stale:
            _disconnect(kept)
    if not is_open(connection):
        connection.connect()  # type: ignore[no-untyped-call]


def _disconnect(kept: redis.Redis) -> None:
    if kept.connection is not None:
        kept.connection.disconnect()  # type: ignore[no-untyped-call]


class _Registry:
    """The lanes of this process: by client (kept while the client lives) and by pool (shared
    by its clients; by ``id(pool)``, which is not reused while the lane, which holds the pool,
    lives)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_client: weakref.WeakKeyDictionary[redis.Redis, Lane] = weakref.WeakKeyDictionary()
        self.by_pool: weakref.WeakValueDictionary[int, Lane] = weakref.WeakValueDictionary()

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()  # another thread of the parent may have held it
        for lane in list(self.by_pool.values()):
            lane.forget()


_registry = _Registry()


def executor_for(client: Any) -> Executor:
    """What to send acquire and release through: the lane of ``client``'s pool if it can have
    one, else ``client.execute_command``."""
    if not _lane_suits(client):
        return client.execute_command  # type: ignore[no-any-return]
    with _registry.lock:
        lane = _registry.by_client.get(client)
        if lane is None:
            pool = client.connection_pool
            lane = _registry.by_pool.get(id(pool))
            if lane is None:
                lane = _registry.by_pool[id(pool)] = Lane(pool)
            _registry.by_client[client] = lane
    return lane.execute


def lane_of(client: Any) -> Lane | None:
    """``client``'s lane in this process, if a semaphore made one (for inspection)."""
    try:
        return _registry.by_client.get(client)
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


os.register_at_fork(after_in_child=_registry.after_fork_in_child)
