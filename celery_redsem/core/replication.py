"""Replica acknowledgement: run a script and ``WAIT`` for replicas in one round trip.

``WAIT n timeout`` counts the replicas that have received every write made *on the same
connection*, so the script and the ``WAIT`` go out together in one non-transactional pipeline
on one connection (on a cluster: a connection to the primary that owns the keys' slot).

``WAIT`` is not consensus. It says the write reached ``n`` replicas' memory; it does not
make a failover pick one of them, nor survive every replica restarting without persistence.
See ``docs/scaling.rst``.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import MovedError, NoScriptError

from celery_redsem.core.node_batch import UNREACHED, relearn_layout
from celery_redsem.core.scripts import LuaScript

__all__ = ["connected_replicas", "forget_primary", "run_acknowledged"]


def _node(client: Any, key: str) -> Any:
    """The client to use for ``key``: itself, or on a cluster the primary owning its slot."""
    if isinstance(client, RedisCluster):
        return client.get_redis_connection(client.get_node_from_key(key))  # type: ignore[no-untyped-call]
    return client


def run_acknowledged(
    script: LuaScript,
    client: Any,
    keys: list[str],
    args: list[Any],
    *,
    replicas: int,
    timeout_ms: int,
) -> tuple[Any, int]:
    """Run ``script`` then ``WAIT replicas timeout_ms`` on the same connection, one round trip.

    Returns the script's reply and how many replicas acknowledged it. ``NOSCRIPT`` (a restarted
    or flushed server) loads the script and sends both again; so does a cluster ``MOVED`` after
    the client relearns the slot layout. A cluster node that cannot be reached makes the client
    relearn the layout before the error is raised, so the next call goes to whoever took its
    place. Other errors are raised as redis-py raised them.
    """
    retries = 2
    while True:
        node = _node(client, keys[0])
        pipe = node.pipeline(transaction=False)
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        pipe.wait(replicas, timeout_ms)
        try:
            reply, acked = pipe.execute(raise_on_error=False)
        except UNREACHED:
            if isinstance(client, RedisCluster):
                relearn_layout(client)
            raise
        if retries and isinstance(reply, NoScriptError):
            node.script_load(script.source)
        elif retries and isinstance(reply, MovedError) and isinstance(client, RedisCluster):
            relearn_layout(client)
        else:
            for result in (reply, acked):
                if isinstance(result, Exception):
                    raise result
            return reply, int(acked)
        retries -= 1


def connected_replicas(client: Any, key: str) -> int:
    """How many replicas the primary serving ``key`` has connected right now."""
    try:
        info = _node(client, key).info("replication")
    except redis.ResponseError:
        return 0
    return int(info.get("connected_slaves", 0))


def forget_primary(client: Any) -> None:
    """Make a Sentinel-managed client ask Sentinel for the primary again at its next call.

    After a failover the old primary may stay up (and writable) until Sentinel demotes it,
    and redis-py keeps using open connections to it. A primary without the replicas it should
    have is a hint of exactly that, so its idle connections are closed.
    """
    from redis.sentinel import SentinelConnectionPool

    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):
        pool.disconnect(inuse_connections=False)
