"""Extending many permits' leases in one round trip per node, never resurrecting a lost one.

No script call refreshes more than :data:`REFRESH_CHUNK` permits: a script blocks every other
client of its server while it runs (10,000 permits in one call took 116 ms of server time),
so a large batch goes as several calls, pipelined in one round trip.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from celery_redsem.core.client import DEFAULT_IDLE_TTL, RedisClient, to_ms
from celery_redsem.core.errors import REDIS_ERRORS, BackendError
from celery_redsem.core.node_batch import Call, run_on_nodes
from celery_redsem.core.permits import Permit, RefreshResult
from celery_redsem.core.scripts import REFRESH, run_script, script_failed
from celery_redsem.core.validation import SECONDS

__all__ = ["REFRESH_CHUNK", "refresh_args", "refresh_permits", "renewed"]

#: The most permits one refresh script call takes (a few milliseconds of server time).
REFRESH_CHUNK = 200


def refresh_permits(
    client: RedisClient, permits: Iterable[Permit], *, idle_ttl: float = DEFAULT_IDLE_TTL
) -> RefreshResult:
    """Extend many permits' leases at once and report which were lost.

    The permits go in script calls of at most :data:`REFRESH_CHUNK` each. On a single server
    they are sent in one pipeline (one round trip). On Redis Cluster the permits are also
    grouped by hash slot (a script may only touch one slot) and the calls go out in one
    pipeline per node, all written before any reply is read: one round trip for all nodes
    (:mod:`~celery_redsem.core.node_batch`).
    A permit is never resurrected: one that expired or was released is reported lost.

    Raises :class:`BackendError` if no permit could be refreshed. Where only some calls failed
    (a cluster node down, an error reply), their permits are in ``failed`` (and the first
    error in ``error``); the others are refreshed or lost as usual.
    """
    batch = list(permits)
    if not batch:
        return RefreshResult()
    idle_ms = to_ms(SECONDS.check(idle_ttl, "idle_ttl"))
    if isinstance(client, RedisCluster):
        groups: dict[int, list[Permit]] = {}
        for permit in batch:
            slot = int(client.keyslot(permit.keys.holders))  # type: ignore[no-untyped-call]
            groups.setdefault(slot, []).append(permit)
        slots = list(groups.values())
    else:
        slots = [batch]
    parts = [s[i : i + REFRESH_CHUNK] for s in slots for i in range(0, len(s), REFRESH_CHUNK)]
    calls: list[tuple[list[str], list[Any]]] = []
    for part in parts:
        keys: list[str] = []
        args: list[Any] = [idle_ms]
        for permit in part:
            keys.append(permit.keys.holders)
            args += refresh_args(permit)
        calls.append((keys, args))
    if len(calls) == 1:
        replies: list[Any] = [run_script(REFRESH, client, *calls[0], batch[0].name)]
    elif isinstance(client, RedisCluster):
        replies = run_on_nodes(REFRESH, client, calls)
    else:
        replies = _pipelined(client, calls, batch[0].name)
    refreshed: list[Permit] = []
    lost: list[Permit] = []
    failed: list[Permit] = []
    first_error: BackendError | None = None
    for part, reply in zip(parts, replies, strict=True):
        if isinstance(reply, Exception):  # its node failed, or the call got an error reply
            failed += part
            if first_error is None:
                first_error = script_failed(REFRESH, part[0].name, reply)
                first_error.__cause__ = reply
            continue
        for permit, expires_at in zip(part, reply, strict=True):
            fresh = renewed(permit, expires_at)
            if fresh is None:
                lost.append(permit)
            else:
                refreshed.append(fresh)
    if first_error is not None and len(failed) == len(batch):
        raise first_error  # no permit could be refreshed
    return RefreshResult(refreshed, lost, failed, first_error)


def _pipelined(client: Any, calls: Sequence[Call], name: str) -> list[Any]:
    """The replies of ``calls`` sent in one pipeline (an error reply in place of a failed
    call); loads the script and sends again the calls answered ``NOSCRIPT``."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        try:
            if attempt:
                client.script_load(REFRESH.source)
            with client.pipeline(transaction=False) as pipe:
                for i in todo:
                    keys, args = calls[i]
                    pipe.execute_command("EVALSHA", REFRESH.sha, len(keys), *keys, *args)
                answers = pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            raise script_failed(REFRESH, name, exc) from exc
        for i, answer in zip(todo, answers, strict=True):
            replies[i] = answer
        todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
        if not todo:
            break
    return replies


def refresh_args(permit: Permit) -> list[Any]:
    """refresh.lua's three arguments for ``permit``: id, fencing token, lease ms."""
    return [permit.id, str(permit.token), to_ms(permit.lease)]


def renewed(permit: Permit, expires_at: Any) -> Permit | None:
    """``permit`` with refresh.lua's answer for it as its new expiry; None if it was lost."""
    expiry = int(expires_at)
    return permit._replace(expires_at=expiry) if expiry > 0 else None
