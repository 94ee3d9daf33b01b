"""Extending many permits' leases in one call per node, never resurrecting a lost one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from redis.cluster import RedisCluster

from celery_redsem.core.client import DEFAULT_IDLE_TTL, RedisClient, to_ms
from celery_redsem.core.errors import BackendError
from celery_redsem.core.node_batch import run_on_nodes
from celery_redsem.core.permits import Permit, RefreshResult
from celery_redsem.core.scripts import REFRESH, run_script, script_failed
from celery_redsem.core.validation import SECONDS

__all__ = ["refresh_permits"]


def refresh_permits(
    client: RedisClient, permits: Iterable[Permit], *, idle_ttl: float = DEFAULT_IDLE_TTL
) -> RefreshResult:
    """Extend many permits' leases at once and report which were lost.

    On a single server this is one script call for all permits. On Redis Cluster the permits are
    grouped by hash slot (a script may only touch one slot) and the per-slot calls go out in one
    pipeline per node, all written before any reply is read: one round trip for all nodes
    (:mod:`~celery_redsem.core.node_batch`).
    A permit is never resurrected: one that expired or was released is reported lost.

    Raises :class:`BackendError` if no permit could be refreshed. On a cluster where only some
    nodes failed, the permits on them are in ``failed`` (and the first error in ``error``);
    the others are refreshed or lost as usual.
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
        parts = list(groups.values())
    else:
        parts = [batch]
    calls: list[tuple[list[str], list[Any]]] = []
    for part in parts:
        keys: list[str] = []
        args: list[Any] = [idle_ms]
        for permit in part:
            keys.append(permit.keys.holders)
            args += [permit.id, str(permit.token), to_ms(permit.lease)]
        calls.append((keys, args))
    if len(calls) == 1:
        replies: list[Any] = [run_script(REFRESH, client, *calls[0], batch[0].name)]
    else:
        assert isinstance(client, RedisCluster)  # only a cluster has several
        replies = run_on_nodes(REFRESH, client, calls)
    refreshed: list[Permit] = []
    lost: list[Permit] = []
    failed: list[Permit] = []
    first_error: BackendError | None = None
    for part, reply in zip(parts, replies, strict=True):
        if isinstance(reply, Exception):  # its node failed (only on a cluster)
            failed += part
            if first_error is None:
                first_error = script_failed(REFRESH, part[0].name, reply)
                first_error.__cause__ = reply
            continue
        for permit, expires_at in zip(part, reply, strict=True):
            if int(expires_at) > 0:
                refreshed.append(
                    Permit(
                        permit.id,
                        permit.name,
                        permit.token,
                        int(expires_at),
                        permit.lease,
                        permit.prefix,
                    )
                )
            else:
                lost.append(permit)
    if first_error is not None and len(failed) == len(batch):
        raise first_error  # no permit could be refreshed
    return RefreshResult(refreshed, lost, failed, first_error)
