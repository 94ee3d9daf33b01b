"""What the asyncio semaphore needs of a ``redis.asyncio`` client: its type, a script call,
and a connection of its own for waiting on a wake-up list.

A blocking ``BLPOP`` holds its connection until a release pushes to the list or its timeout
ends. Sent through the client's pool, it would hold a connection other coroutines may need
(a bounded pool would run dry with a few waiters), so :class:`WakeWaiter` opens its own,
with the client's connection settings, and closes it when the wait is over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from celery_redsem.core.errors import REDIS_ERRORS, BackendError, ConfigurationError
from celery_redsem.core.scripts import LuaScript, script_failed

__all__ = [
    "WAKE_READ_SLACK",
    "AsyncRedisClient",
    "CancelWatch",
    "WakeWaiter",
    "run_script",
    "validate_client",
]

#: The clients the asyncio semaphore works with: a server (also Sentinel's ``master_for``) or
#: a cluster, from ``redis.asyncio``.
AsyncRedisClient = Redis | RedisCluster

#: Seconds a wake-up wait's reply may come after its ``BLPOP`` timeout: a timed-out blocking
#: command is answered on the server's next timer tick (1 s at the slowest ``hz 1``).
WAKE_READ_SLACK = 2.0


class CancelWatch:
    """Notices a cancellation of the current task that a Redis call swallowed.

    Before Python 3.12, ``asyncio.wait_for`` (which redis-py sends commands through when a
    socket timeout is set) returns its result instead of raising when the task is cancelled
    just as the send completes. The task then goes on as if never cancelled: a blocking
    acquire would wait for a permit no one wants. :meth:`check`, called after each Redis call
    of a loop, raises the lost ``CancelledError`` (Python 3.11+, where tasks count their
    cancellation requests; on 3.10 there is no count to read, and it does nothing).
    """

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self._before = self._requests()

    def _requests(self) -> int:
        cancelling = getattr(self._task, "cancelling", None)
        return int(cancelling()) if cancelling is not None else 0

    def check(self) -> None:
        """Raise ``CancelledError`` if the task was asked to cancel since this watch began."""
        if self._requests() > self._before:
            raise asyncio.CancelledError


def validate_client(client: object) -> AsyncRedisClient:
    """``client`` if it is a ``redis.asyncio`` client, else a ConfigurationError."""
    if not isinstance(client, Redis | RedisCluster):
        raise ConfigurationError(
            "client must be a redis.asyncio.Redis or redis.asyncio.cluster.RedisCluster, got "
            f"{type(client).__module__}.{type(client).__qualname__}; create one with "
            "redis.asyncio.Redis.from_url('redis://host:6379/0') (for a sync client, use "
            "celery_redsem.FairSemaphore)"
        )
    return client


async def run_script(
    script: LuaScript, client: AsyncRedisClient, keys: Sequence[str], args: Sequence[Any], name: str
) -> Any:
    """Run ``script`` with ``EVALSHA``; on ``NOSCRIPT`` load it and send again (``EVAL`` if the
    cache was flushed once more in between). A Redis error becomes a BackendError about the
    semaphore ``name``."""
    call = ("EVALSHA", script.sha_bytes, len(keys), *keys, *args)
    try:
        if isinstance(client, RedisCluster):
            # Learn the layout first (a flag test once done, and locked): a first call picks
            # its node before it does, and a crowd of first calls broke each other's
            # connections (redis-py 8.1).
            await client.initialize()
        try:
            return await client.execute_command(*call)
        except NoScriptError:
            await client.script_load(script.source)
        try:
            return await client.execute_command(*call)
        except NoScriptError:
            return await client.execute_command("EVAL", script.source, *call[2:])
    except REDIS_ERRORS as exc:
        raise script_failed(script, name, exc) from exc


class WakeWaiter:
    """Waits on wake-up lists over a connection of its own, opened at the first wait (to the
    node that serves the list, on a cluster) and closed by :meth:`close`."""

    def __init__(self, client: AsyncRedisClient, name: str) -> None:
        self.client = client
        self.name = name
        self._connection: Any = None
        self.cancel = CancelWatch()  # (made in the waiting task)

    async def pop(self, key: str, seconds: float, permit_id: str) -> Any:
        """Pop the first element of list ``key``, waiting at most ``seconds`` (at least 10 ms)
        for one; None if none came. A Redis error becomes a BackendError."""
        timeout = max(0.01, seconds)
        try:
            if self._connection is None:
                self._connection = self._open(key)
            await self._connection.send_command("BLPOP", key, f"{timeout:.3f}")
            self.cancel.check()  # (the reply left unread: close() drops the connection)
            reply = await self._connection.read_response(timeout=timeout + WAKE_READ_SLACK)
        except REDIS_ERRORS as exc:
            await self.close()  # a reply may still come: it must not be read as the next one
            raise BackendError(
                f"Redis failed while waiting for {self.name!r}: {exc}",
                name=self.name,
                permit_id=permit_id,
            ) from exc
        return None if reply is None else reply[1]

    def _open(self, key: str) -> Any:
        if isinstance(self.client, RedisCluster):
            source: Any = self.client.get_node_from_key(key)
        else:
            source = self.client.connection_pool
        return source.connection_class(**source.connection_kwargs)

    async def close(self) -> None:
        """Close the connection, if one was opened."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.disconnect()
