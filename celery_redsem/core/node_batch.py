"""Run one script many times on Redis Cluster: one pipeline per node, all sent before any is read.

redis-py's cluster pipeline asks the default node ``COMMAND GETKEYS`` for every ``EVALSHA`` in
it (a round trip each, before anything is sent), and raises for the whole batch when any node
is unreachable. This sends each node its share of the calls on one connection, then reads the
replies: one round trip for all nodes, and a node that fails fails only its own calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import Any, Protocol

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AskError, MovedError, NoScriptError

from celery_redsem.core.connections import check_out
from celery_redsem.core.errors import REDIS_ERRORS

__all__ = ["UNREACHED", "relearn_layout", "run_on_nodes"]

#: Errors that say a node could not be reached (not that it refused a call).
UNREACHED = (redis.ConnectionError, redis.TimeoutError)

#: One script call: its keys (all in one slot) and its arguments.
Call = tuple[Sequence[str], Sequence[Any]]


class LuaScript(Protocol):
    """What a batch needs of a script (:class:`~celery_redsem.core.scripts.LuaScript`)."""

    source: str
    sha: str

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any: ...


def run_on_nodes(script: LuaScript, client: RedisCluster, calls: Sequence[Call]) -> list[Any]:
    """The replies of ``calls``, in order; an exception in place of each call that failed.

    A node that cannot be reached makes the client relearn the layout (a replica may have
    been promoted in its place: a dead node never answers ``MOVED``), and calls whose slot
    now has another owner are sent there. A node that answers ``NOSCRIPT`` gets the script
    loaded and its calls sent again. A call answered ``MOVED`` or ``ASK`` (its slot changed
    owner, or is migrating) is sent again on its own through the client, which follows the
    redirect (and relearns the layout).
    """
    replies = _send_and_read(script, client, calls, range(len(calls)))
    unreached = [i for i, reply in enumerate(replies) if isinstance(reply, UNREACHED)]
    if unreached:
        before = {i: _node_name(client, calls[i]) for i in unreached}
        relearn_layout(client)
        moved = [i for i in unreached if _node_name(client, calls[i]) != before[i]]
        for i, reply in zip(moved, _send_and_read(script, client, calls, moved), strict=True):
            replies[i] = reply
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    loaded: list[int] = []
    for node, node_calls in _by_node(client, calls, missing):
        try:  # on this node only: another one may be down
            client.get_redis_connection(node).script_load(script.source)
            loaded += node_calls
        except REDIS_ERRORS as exc:
            for i in node_calls:
                replies[i] = exc
    for i, reply in zip(loaded, _send_and_read(script, client, calls, loaded), strict=True):
        replies[i] = reply
    redirected = [i for i, reply in enumerate(replies) if isinstance(reply, AskError)]
    if any(isinstance(replies[i], MovedError) for i in redirected):
        relearn_layout(client)
    for i in redirected:  # rare: one call at a time, as the client routes it
        replies[i] = _call_through_client(script, client, calls[i])
    return replies


def relearn_layout(client: RedisCluster) -> None:
    """Ask the cluster for its slot layout again (after a node could not be reached)."""
    with suppress(*REDIS_ERRORS):
        client.nodes_manager.initialize()


def _node_name(client: RedisCluster, call: Call) -> str:
    return str(client.get_node_from_key(call[0][0]).name)  # type: ignore[no-untyped-call]


def _call_through_client(script: LuaScript, client: RedisCluster, call: Call) -> Any:
    """One call sent by the cluster client itself: its reply, or the exception it raised."""
    try:
        return script(client, *call)
    except REDIS_ERRORS as exc:
        return exc


def _send_and_read(
    script: LuaScript, client: RedisCluster, calls: Sequence[Call], indexes: Sequence[int]
) -> list[Any]:
    """Send each node its calls among ``indexes``, then read every node's replies."""
    replies: dict[int, Any] = {}
    sent: list[tuple[Any, Any, list[int]]] = []
    for node, node_calls in _by_node(client, calls, indexes):
        pool = client.get_redis_connection(node).connection_pool
        connection = None
        try:
            connection = check_out(pool)
            commands = [
                ("EVALSHA", script.sha, len(calls[i][0]), *calls[i][0], *calls[i][1])
                for i in node_calls
            ]
            packed = connection.pack_commands(commands)
            connection.send_packed_command(packed)
            sent.append((pool, connection, node_calls))
        except REDIS_ERRORS as exc:
            _discard(pool, connection)
            replies.update(dict.fromkeys(node_calls, exc))
    for pool, connection, node_calls in sent:
        try:
            for i in node_calls:
                try:
                    replies[i] = connection.read_response()
                except redis.ResponseError as exc:  # this call's error; the connection is fine
                    replies[i] = exc
        except REDIS_ERRORS as exc:
            _discard(pool, connection)
            replies.update({i: exc for i in node_calls if i not in replies})
        else:
            pool.release(connection)
    return [replies[i] for i in indexes]


def _by_node(
    client: RedisCluster, calls: Sequence[Call], indexes: Sequence[int]
) -> list[tuple[Any, list[int]]]:
    """``indexes`` of ``calls`` grouped by the node that serves their first key."""
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i in indexes:
        node = client.get_node_from_key(calls[i][0][0])  # type: ignore[no-untyped-call]
        by_node.setdefault(str(node.name), (node, []))[1].append(i)
    return list(by_node.values())


def _discard(pool: Any, connection: Any) -> None:
    """Close a connection that failed mid-exchange (its replies may be out of step)."""
    if connection is not None:
        connection.disconnect()
        pool.release(connection)
