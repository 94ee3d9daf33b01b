"""Grouped (fair-share) semaphores on a real 3-primary Redis Cluster (every key of a semaphore,
its per-group keys too, in one slot; grants, the fair order and wake-ups across the nodes), and
with min_replicas on a primary with a replica."""

from __future__ import annotations

import threading

import pytest
from redis.cluster import RedisCluster

from celery_redsem import FairSemaphore, Permit, Waiting
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.state import read_groups
from tests.scale.test_cluster import assert_one_slot_per_name
from tests.servers import Cluster, wait_until

pytestmark = pytest.mark.slow


def spread_names(client: RedisCluster, prefix: str, n: int) -> list[str]:
    names = [f"api:{i}" for i in range(n)]
    nodes = {client.get_node_from_key(SemaphoreKeys(prefix, m).holders).name for m in names}
    assert len(nodes) == 3, "the names must land on every primary"
    return names


def test_every_key_of_a_grouped_semaphore_shares_one_slot(
    cluster: Cluster, cluster_client: RedisCluster, scale_prefix: str
) -> None:
    names = spread_names(cluster_client, scale_prefix, 24)
    for name in names:
        sem = FairSemaphore(
            cluster_client, name, 2, lease=30, prefix=scale_prefix, grouped=True, group_limit=1
        )
        assert isinstance(sem.attempt("a-0", group="a"), Permit)
        assert isinstance(sem.attempt("a-1", join_line=True, group="a"), Waiting)  # capped
        assert isinstance(sem.attempt("b-0", join_line=True, group="b", weight=2), Permit)
        assert isinstance(sem.attempt("c-0", join_line=True, group="c"), Waiting)
        groups = {g.group: (g.holders, g.waiting, g.at_limit) for g in sem.groups()}
        assert groups == {"a": (1, 1, True), "b": (1, 0, False), "c": (0, 1, False)}
    assert_one_slot_per_name(cluster, cluster_client, scale_prefix, names)


def test_a_release_wakes_the_next_group_on_its_node(
    cluster_client: RedisCluster, scale_prefix: str
) -> None:
    for name in spread_names(cluster_client, scale_prefix, 6)[:3]:
        sem = FairSemaphore(cluster_client, name, 1, lease=30, prefix=scale_prefix, grouped=True)
        held = sem.acquire(permit_id="a-0", group="a")
        assert isinstance(held, Permit)
        assert isinstance(sem.attempt("a-1", join_line=True, group="a"), Waiting)
        got: list[Permit | None] = []
        waiter = threading.Thread(
            target=lambda s=sem, out=got: out.append(
                s.acquire(blocking=True, timeout=10, permit_id="b-0", group="b")
            )
        )
        waiter.start()
        wait_until(
            lambda s=sem: any(g.group == "b" and g.waiting for g in s.groups()),
            5,
            what="b to wait",
        )
        assert sem.release(held)
        waiter.join(10)
        assert len(got) == 1
        assert isinstance(got[0], Permit)  # b before a's second: a was served once, b never
        assert got[0].token > held.token
        assert isinstance(sem.attempt("a-1", join_line=True, group="a"), Waiting)


def test_a_grouped_grant_with_min_replicas_is_on_the_replica(replicated, scale_prefix):
    primary = replicated.primary.client(socket_timeout=5)
    try:
        sem = FairSemaphore(
            primary, "acked", 1, prefix=scale_prefix, grouped=True, min_replicas=1, lease=30
        )
        permit = sem.attempt("a-0", group="a")
        assert isinstance(permit, Permit)
        replica = replicated.replicas[0].client()
        try:  # WAIT returned before the reply: the replica has the grant and its group
            assert {
                g.group: g.holders for g in read_groups(replica, "acked", prefix=scale_prefix)
            } == {"a": 1}
        finally:
            replica.close()
        again = sem.attempt("a-0", group="a")  # a renewal, acknowledged: the same grant
        assert isinstance(again, Permit)
        assert again.token == permit.token
        assert isinstance(sem.attempt("b-0", join_line=True, group="b"), Waiting)
        assert sem.release(permit)
        assert isinstance(sem.attempt("b-0", join_line=True, group="b"), Permit)
    finally:
        primary.close()
