"""The core on a real 3-primary Redis Cluster: many semaphores across slots and nodes."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner
from redis.cluster import RedisCluster

from celery_redsem import FairSemaphore, Lock, Permit, read_state, refresh_permits
from celery_redsem.core.clients import client_from_url
from celery_redsem.core.errors import BackendError, ConfigurationError, NotEnoughReplicas
from celery_redsem.core.heartbeat import Heartbeat, HeldPermit
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.scripts import REFRESH
from celery_redsem.integration.settings import reset
from celery_redsem.ops.admin import states
from celery_redsem.ops.cli import redsem
from tests.scale.acl import PASSWORD, create_user
from tests.servers import Cluster, valkey_cluster, wait_until

pytestmark = pytest.mark.slow

N_SEMAPHORES = 150


def node_of(client: RedisCluster, key: str) -> str:
    return str(client.get_node_from_key(key).name)


def spread_names(client: RedisCluster, prefix: str, n: int) -> list[str]:
    names = [f"acct:{i}" for i in range(n)]
    nodes = {node_of(client, SemaphoreKeys(prefix, name).holders) for name in names}
    assert len(nodes) == 3, "the names must land on every primary"
    return names


def calls_of(cluster: Cluster, command: str) -> dict[int, int]:
    """How often each node has run ``command`` (as INFO commandstats names it)."""
    counts = {}
    for node in cluster.nodes:
        client = node.client()
        try:
            stats = client.info("commandstats").get(f"cmdstat_{command}", {})
        finally:
            client.close()
        counts[node.port] = int(stats.get("calls", 0))
    return counts


def test_the_limit_holds_on_every_semaphore_on_every_node(cluster_client, scale_prefix):
    names = spread_names(cluster_client, scale_prefix, N_SEMAPHORES)
    sems = [FairSemaphore(cluster_client, n, 2, lease=30, prefix=scale_prefix) for n in names]
    permits = [s.acquire(permit_id=f"{s.name}/{j}") for s in sems for j in range(2)]
    assert all(isinstance(p, Permit) for p in permits)
    assert all(s.acquire() is None for s in sems), "a third holder got in"
    for sem in sems:
        state = read_state(cluster_client, sem.name, prefix=scale_prefix)
        assert state.limit == 2
        assert len(state.holders) == 2
    tokens = defaultdict(list)
    for permit in permits:
        tokens[permit.name].append(permit.token)  # type: ignore[union-attr]
    assert all(a < b for a, b in tokens.values())
    owners = [s for s in sems for _ in range(2)]
    assert all(s.release(p) for s, p in zip(owners, permits, strict=True))  # type: ignore[arg-type]
    assert all(s.acquire() is not None for s in sems)


def test_every_key_of_a_semaphore_shares_one_slot(cluster, cluster_client, scale_prefix):
    names = spread_names(cluster_client, scale_prefix, 30)
    for name in names:
        sem = FairSemaphore(cluster_client, name, 1, lease=30, prefix=scale_prefix)
        assert isinstance(sem.acquire(permit_id="holder"), Permit)
        sem.attempt("waiter", join_line=True)
    per_node = assert_one_slot_per_name(cluster, cluster_client, scale_prefix, names)
    assert all(count > 0 for count in per_node.values()), per_node


def assert_one_slot_per_name(
    cluster: Cluster, cluster_client: RedisCluster, prefix: str, names: list[str]
) -> dict[int, int]:
    """Check that the keys under ``prefix`` on every node are those of ``names``, each name's
    in one slot; return how many keys each node (by port) holds."""
    by_name: dict[str, set[int]] = defaultdict(set)
    per_node: dict[int, int] = {}
    for node in cluster.nodes:
        client = node.client()
        try:
            keys = [k.decode() for k in client.scan_iter(match=f"{prefix}:*", count=500)]
        finally:
            client.close()
        per_node[node.port] = len(keys)
        for key in keys:
            name = SemaphoreKeys.name_from_key(prefix, key)
            assert name in names, key
            by_name[name].add(int(cluster_client.keyslot(key)))
    assert set(by_name) == set(names)
    assert all(len(slots) == 1 for slots in by_name.values())
    return per_node


def test_refresh_sends_one_script_call_per_slot_in_one_pipeline(
    cluster, cluster_client, scale_prefix
):
    names = spread_names(cluster_client, scale_prefix, 60)
    sems = {n: FairSemaphore(cluster_client, n, 3, lease=5, prefix=scale_prefix) for n in names}
    permits = [sems[n].acquire(permit_id=f"task-{n}-{j}") for n in names for j in range(3)]
    assert all(isinstance(p, Permit) for p in permits)
    gone = permits[7]
    assert sems[gone.name].release(gone)  # type: ignore[union-attr, arg-type]
    slots = {cluster_client.keyslot(SemaphoreKeys(scale_prefix, n).holders) for n in names}

    for node in cluster.nodes:
        client = node.client()
        client.script_load(REFRESH.source)  # so that no NOSCRIPT reply is counted
        client.close()
    before = calls_of(cluster, "evalsha")
    lookups_before = calls_of(cluster, "command|getkeys")
    result = refresh_permits(cluster_client, permits, idle_ttl=60)  # type: ignore[arg-type]
    after = calls_of(cluster, "evalsha")
    # redis-py's cluster pipeline would first ask COMMAND GETKEYS for each call, one by one.
    assert calls_of(cluster, "command|getkeys") == lookups_before

    assert result.lost == [gone]
    assert len(result.refreshed) == len(permits) - 1
    old = {(p.id, p.token): p.expires_at for p in permits}  # type: ignore[union-attr]
    assert all(p.expires_at >= old[p.id, p.token] for p in result.refreshed)
    assert sum(after.values()) - sum(before.values()) == len(slots)
    assert all(after[port] > before[port] for port in after), "every node got its share"


def test_refresh_reloads_scripts_a_flush_removed_on_every_node(
    cluster, cluster_client, scale_prefix
):
    names = spread_names(cluster_client, scale_prefix, 20)
    permits = [
        FairSemaphore(cluster_client, n, 1, lease=5, prefix=scale_prefix).acquire() for n in names
    ]
    for node in cluster.nodes:
        client = node.client()
        client.script_flush()
        client.close()
    result = refresh_permits(cluster_client, permits)  # type: ignore[arg-type]
    assert len(result.refreshed) == len(permits)
    assert not result.lost


def test_a_blocked_waiter_is_woken_by_a_release(cluster_client, scale_prefix):
    lock = Lock(cluster_client, "report:7", lease=30, prefix=scale_prefix)
    held = lock.acquire(permit_id="first")
    assert isinstance(held, Permit)
    got: list[Permit | None] = []
    waiter = threading.Thread(
        target=lambda: got.append(lock.acquire(blocking=True, timeout=10, permit_id="second"))
    )
    waiter.start()
    wait_until(lock.waiters, 5, what="the waiter to join the line")
    lock.release(held)
    waiter.join(10)
    assert len(got) == 1
    assert isinstance(got[0], Permit)
    assert got[0].token > held.token


def test_a_blocking_wait_stays_clear_of_the_socket_timeout(cluster, scale_prefix):
    # The waiter lease (30 s) would make each wake-up wait 10 s; the socket times out at 0.5 s.
    client = cluster.client(socket_timeout=0.5)
    try:
        lock = Lock(client, "slow", lease=30, prefix=scale_prefix)
        assert lock.acquire() is not None
        started = time.monotonic()
        assert lock.acquire(blocking=True, timeout=1.5) is None  # no socket timeout error
        assert time.monotonic() - started >= 1.4
    finally:
        client.close()


def test_concurrent_holders_never_exceed_the_limit(cluster_client, scale_prefix):
    limit, threads, rounds = 2, 6, 12
    sem = FairSemaphore(cluster_client, "shared", limit, lease=10, prefix=scale_prefix)
    guard = threading.Lock()
    inside = [0]
    peak = [0]
    seen_by_server: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(rounds):
                permit = sem.acquire(blocking=True, timeout=20)
                assert permit is not None
                with guard:
                    inside[0] += 1
                    peak[0] = max(peak[0], inside[0])
                seen_by_server.append(len(sem.holders()))
                with guard:
                    inside[0] -= 1
                sem.release(permit)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not errors
    assert len(seen_by_server) == threads * rounds
    assert peak[0] <= limit
    assert max(seen_by_server) <= limit


def test_status_and_the_cli_cover_every_node(cluster, cluster_client, scale_prefix):
    names = spread_names(cluster_client, scale_prefix, 24)
    for name in names:
        FairSemaphore(cluster_client, name, 3, lease=30, prefix=scale_prefix).acquire()
    found, total = states(cluster_client, prefix=scale_prefix)
    assert total == len(names)
    assert sorted(s.name for s in found) == sorted(names)

    app = Celery("redsem-cluster-cli", broker="memory://", set_as_current=False)
    app.conf.redsem_redis_url = cluster.url
    app.conf.redsem_key_prefix = scale_prefix
    try:
        obj = CLIContext(app=app, no_color=True, workdir=None)
        result = CliRunner().invoke(redsem, ["status", "--json"], obj=obj)
    finally:
        reset(app)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    assert data["total"] == len(names)
    assert {s["name"] for s in data["semaphores"]} == set(names)


def test_a_cluster_url_gives_a_cluster_client(cluster, scale_prefix):
    client = client_from_url(cluster.url, socket_timeout=5)
    try:
        assert isinstance(client, RedisCluster)
        assert len(client.get_primaries()) == 3
        sem = FairSemaphore(client, "via-url", 1, prefix=scale_prefix)
        assert isinstance(sem.acquire(), Permit)
    finally:
        client.close()
    with pytest.raises(ConfigurationError, match="only database 0"):
        client_from_url(cluster.url + "/1")


def test_a_cluster_url_with_ipv6_addresses_reaches_the_cluster(scale_prefix):
    with valkey_cluster(1, extra=["--bind", "127.0.0.1", "::1"]) as v6:
        port = v6.nodes[0].port
        client = client_from_url(f"redis+cluster://[::1]:{port},[::1]:{port}")
        try:
            assert isinstance(client, RedisCluster)
            assert isinstance(Lock(client, "v6", prefix=scale_prefix).acquire(), Permit)
        finally:
            client.close()


def test_an_unreachable_cluster_is_a_backend_error_without_the_password():
    with pytest.raises(BackendError) as info:
        client_from_url("redis+cluster://app:s3cret-pw@127.0.0.1:1", socket_connect_timeout=0.5)
    assert "s3cret-pw" not in str(info.value)
    assert "app:***@127.0.0.1:1" in str(info.value)


def test_min_replicas_on_a_cluster_without_replicas_is_refused_and_released(
    cluster_client, scale_prefix
):
    sem = FairSemaphore(
        cluster_client, "acked", 1, prefix=scale_prefix, min_replicas=1, replica_timeout=0.05
    )
    with pytest.raises(NotEnoughReplicas, match="0 replica"):
        sem.attempt("task-1")
    assert sem.holders() == []


def test_the_documented_acl_rule_works_on_every_node(cluster, scale_prefix):
    for node in cluster.nodes:
        client = node.client()
        create_user(client, scale_prefix, f"app-{scale_prefix}")
        client.close()
    hosts = ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes)
    app_client = client_from_url(f"redis+cluster://app-{scale_prefix}:{PASSWORD}@{hosts}")
    try:
        names = spread_names(app_client, scale_prefix, 30)
        sems = [FairSemaphore(app_client, n, 1, prefix=scale_prefix) for n in names]
        permits = [s.acquire() for s in sems]
        assert all(isinstance(p, Permit) for p in permits)
        assert len(refresh_permits(app_client, permits).refreshed) == 30  # type: ignore[arg-type]
        assert states(app_client, prefix=scale_prefix)[1] == 30
        with pytest.raises(BackendError, match=r"(?i)no permissions"):
            FairSemaphore(app_client, "x", 1, prefix="elsewhere").acquire()
    finally:
        app_client.close()


def test_a_node_down_fails_only_the_refreshes_of_its_own_permits(scale_prefix):
    # Its own cluster: this test kills a node. Permits on the healthy nodes must go on being
    # refreshed, not count as unconfirmed (and so, after a lease, as lost) with the others.
    with valkey_cluster(3) as doomed_cluster:
        client = doomed_cluster.client()
        heartbeat = Heartbeat()
        try:
            names = spread_names(client, scale_prefix, 30)
            doomed_node = node_of(client, SemaphoreKeys(scale_prefix, names[0]).holders)
            elsewhere = next(
                n
                for n in names
                if node_of(client, SemaphoreKeys(scale_prefix, n).holders) != doomed_node
            )
            doomed, healthy = (
                Lock(client, name, lease=1.5, prefix=scale_prefix).acquire()
                for name in (names[0], elsewhere)
            )
            assert isinstance(doomed, Permit)
            assert isinstance(healthy, Permit)
            next(n for n in doomed_cluster.nodes if doomed_node.endswith(f":{n.port}")).kill()

            result = refresh_permits(client, [doomed, healthy])
            assert [p.name for p in result.refreshed] == [healthy.name]
            assert result.lost == []
            assert result.failed == [doomed]
            assert isinstance(result.error, BackendError)
            assert names[0] in str(result.error)

            held = [heartbeat.track(HeldPermit(p, client)) for p in (doomed, healthy)]
            wait_until(lambda: held[0].lost, 5, what="the permit on the dead node to be lost")
            refreshed_at = held[1].expires_at
            wait_until(lambda: held[1].expires_at > refreshed_at, 2, what="another refresh")
            assert not held[1].lost  # more than a lease after the node died
        finally:
            heartbeat.stop()
            client.close()


def test_the_heartbeat_follows_a_failover_to_the_promoted_replica(scale_prefix):
    # A dead primary never answers MOVED: its permits are refreshed on the replica that took
    # its place as soon as the cluster promotes it, not reported lost a lease later.
    with valkey_cluster(3, with_replicas=True, node_timeout_ms=1000) as cluster:
        client = cluster.client(socket_timeout=2, socket_connect_timeout=2)
        heartbeat = Heartbeat()
        try:
            names = spread_names(client, scale_prefix, 12)
            permits = [
                Lock(client, name, lease=10, prefix=scale_prefix).acquire() for name in names
            ]
            assert all(isinstance(p, Permit) for p in permits)
            victim = cluster.nodes[1]
            on_victim = [
                p
                for p in permits
                if node_of(client, SemaphoreKeys(scale_prefix, p.name).holders).endswith(
                    f":{victim.port}"
                )
            ]
            assert on_victim  # spread_names put some there
            victim.kill()
            promoted = cluster.replicas[1]
            wait_until(
                lambda: promoted.client().info("replication")["role"] == "master",
                20,
                what="the replica to be promoted",
            )

            def all_refreshed() -> bool:
                try:  # the cluster may answer CLUSTERDOWN for a moment after the promotion
                    result = refresh_permits(client, permits)
                except BackendError:
                    return False
                assert result.lost == []
                return len(result.refreshed) == len(names)

            wait_until(
                all_refreshed, 10, what="every permit refreshed, those of the dead primary too"
            )
            held = [heartbeat.track(HeldPermit(p, client)) for p in on_victim]
            confirmed = [h.expires_at for h in held]
            wait_until(
                lambda: all(h.expires_at > at for h, at in zip(held, confirmed, strict=True)),
                15,
                what="the heartbeat to refresh them on the promoted replica",
            )
            assert not any(h.lost for h in held)
        finally:
            heartbeat.stop()
            client.close()


def test_a_semaphore_split_by_a_slot_migration_is_retried_not_run_on_half_its_keys(scale_prefix):
    # Resharding moves keys in batches: for a while the line's keys can be on the new node and
    # the holders on the old. The call must be redirected or refused for a retry (its keys are
    # declared), never run on half of them or fail as if the request were wrong.
    with valkey_cluster(3) as moving:
        client = moving.client()
        try:
            sem = FairSemaphore(client, "moving", 1, lease=30, prefix=scale_prefix)
            held = sem.attempt("A")
            assert isinstance(held, Permit)
            assert sem.attempt("W1", join_line=True, waiter_lease=30).position == 1
            keys, slot = sem.keys, client.keyslot(sem.keys.holders)
            steady = Lock(client, "steady", lease=30, prefix=scale_prefix).acquire()
            assert steady is not None
            assert client.keyslot(steady.keys.holders) != slot
            permits = [held, steady]  # refreshed in one batch, one call per slot
            source = next(
                n for n in moving.nodes if node_of(client, keys.holders).endswith(f":{n.port}")
            )
            target = next(n for n in moving.nodes if n is not source)
            admin = {n.port: n.client() for n in moving.nodes}
            ids = {port: node.execute_command("CLUSTER MYID") for port, node in admin.items()}
            admin[target.port].execute_command(
                "CLUSTER SETSLOT", slot, "IMPORTING", ids[source.port]
            )
            admin[source.port].execute_command(
                "CLUSTER SETSLOT", slot, "MIGRATING", ids[target.port]
            )
            line = [keys.waiters, keys.waiter_expiry, keys.waiter_due]
            admin[source.port].execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *line
            )
            with pytest.raises(BackendError) as mid_move:
                sem.attempt("W2", join_line=True, waiter_lease=30)
            assert mid_move.value.transient  # a Celery task retries, it does not fail

            admin[source.port].execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", keys.holders
            )
            # The old node answers ASK for the moved holders: the refresh follows it.
            assert len(refresh_permits(client, permits).refreshed) == 2
            for node in admin.values():
                node.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target.port])
            # And MOVED, once the slot is the new node's.
            assert len(refresh_permits(client, permits).refreshed) == 2
            # redis-py follows the MOVED reply to the new node; W2 queues behind W1.
            assert sem.attempt("W2", join_line=True, waiter_lease=30).position == 2
            assert [w.permit_id for w in sem.state().waiters] == ["W1", "W2"]
            for node in admin.values():
                node.close()
        finally:
            client.close()
