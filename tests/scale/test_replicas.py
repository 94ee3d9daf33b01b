"""Replica acknowledgement (``min_replicas``) against a real primary and replica."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from celery_redsem import BackendError, FairSemaphore, Lock, Permit, Waiting, read_state
from celery_redsem.core.errors import ConfigurationError, NotEnoughReplicas
from celery_redsem.integration.settings import get_client
from tests.integration.apps.tasks import make_app
from tests.integration.conftest import close_app
from tests.servers import Replicated, primary_with_replica, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def primary(replicated: Replicated) -> Iterator[redis.Redis]:
    client = replicated.primary.client(socket_timeout=5)
    yield client
    client.close()


def on_replica(replicated: Replicated, prefix: str, name: str, permit_id: str) -> bool:
    client = replicated.replicas[0].client()
    try:
        state = read_state(client, name, prefix=prefix)  # a read-only script: fine on a replica
    finally:
        client.close()
    return permit_id in {h.permit_id for h in state.holders}


def test_an_acknowledged_grant_is_on_the_replica_when_it_is_returned(
    replicated, primary, scale_prefix
):
    sem = FairSemaphore(primary, "acked", 2, prefix=scale_prefix, min_replicas=1)
    for task in ("task-1", "task-2"):
        permit = sem.attempt(task)
        assert isinstance(permit, Permit)
        # WAIT returned before the reply: no polling needed, the replica has it already.
        assert on_replica(replicated, scale_prefix, "acked", task)
    third = sem.attempt("task-3", join_line=True)
    assert isinstance(third, Waiting)
    assert third.position == 1
    assert sem.release(sem.attempt("task-1"))  # type: ignore[arg-type]


def test_a_renewal_too_few_replicas_acknowledged_is_not_used_but_kept(redis_client, prefix):
    # The id already holds the permit (a redelivered task asks again, or redis-py resent a
    # call whose connection dropped during WAIT, so its first grant's acknowledgement was
    # never seen): an unacknowledged renewal must not let the caller run, and giving it back
    # could free a permit another run of the id still uses. It is left as it was.
    held = Lock(redis_client, "acked", prefix=prefix, lease=30).attempt("task-1")
    assert isinstance(held, Permit)
    acked = Lock(
        redis_client, "acked", prefix=prefix, lease=30, min_replicas=1, replica_timeout=0.05
    )
    with pytest.raises(NotEnoughReplicas, match="not used"):  # no replica here at all
        acked.attempt("task-1")
    assert [(h.permit_id, h.token) for h in acked.holders()] == [("task-1", held.token)]
    assert isinstance(acked.attempt("task-2"), Waiting)  # still one holder at a time


def test_a_renewal_a_stalled_replica_did_not_acknowledge_is_not_used(
    replicated, primary, scale_prefix
):
    held = Lock(primary, "renewed", prefix=scale_prefix, lease=30).attempt("task-1")
    assert isinstance(held, Permit)
    acked = Lock(
        primary, "renewed", prefix=scale_prefix, lease=30, min_replicas=1, replica_timeout=0.2
    )
    replica = replicated.replicas[0].process
    assert replica is not None
    os.kill(replica.pid, signal.SIGSTOP)  # connected, but acknowledges nothing
    try:
        again = acked.attempt("task-1")
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    assert isinstance(again, Waiting)
    assert again.position == 0
    assert [(h.permit_id, h.token) for h in acked.holders()] == [("task-1", held.token)]
    wait_until(  # once the replica has it, the renewal is acknowledged and used
        lambda: isinstance(acked.attempt("task-1"), Permit), 10, what="an acknowledged renewal"
    )


def test_no_replica_at_all_is_a_clear_error_and_nothing_stays_held(redis_client, prefix):
    sem = Lock(redis_client, "acked", prefix=prefix, min_replicas=1, replica_timeout=0.05)
    with pytest.raises(NotEnoughReplicas) as info:
        sem.attempt("task-1")
    assert "min_replicas=1" in str(info.value)
    assert "0 replica(s) connected" in str(info.value)
    assert info.value.name == "acked"
    assert info.value.permit_id == "task-1"
    assert sem.holders() == []
    with pytest.raises(NotEnoughReplicas):
        sem.acquire(blocking=True, timeout=1)


def test_more_replicas_asked_than_exist_is_a_clear_error(replicated, primary, scale_prefix):
    sem = FairSemaphore(
        primary, "acked", 1, prefix=scale_prefix, min_replicas=2, replica_timeout=0.05
    )
    with pytest.raises(NotEnoughReplicas, match=r"min_replicas=2 .* 1 replica"):
        sem.attempt("task-1")
    assert sem.holders() == []


def test_a_stalled_replica_means_not_acquired_and_released(replicated, primary, scale_prefix):
    sem = FairSemaphore(
        primary, "acked", 1, prefix=scale_prefix, min_replicas=1, replica_timeout=0.2
    )
    replica = replicated.replicas[0].process
    assert replica is not None
    os.kill(replica.pid, signal.SIGSTOP)  # connected, but acknowledges nothing
    try:
        result = sem.attempt("task-1", join_line=True)
        assert isinstance(result, Waiting)
        assert result.position == 0
        assert sem.holders() == []
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    wait_until(
        lambda: isinstance(sem.attempt("task-1"), Permit), 10, what="a grant once the replica runs"
    )


def test_an_acknowledged_grant_survives_promoting_the_replica(scale_prefix):
    with primary_with_replica() as own:
        primary = own.primary.client(socket_timeout=5)
        replica = own.replicas[0].client(socket_timeout=5)
        try:
            promote_and_check(primary, replica, scale_prefix)
        finally:
            primary.close()
            replica.close()


def promote_and_check(primary: redis.Redis, replica: redis.Redis, scale_prefix: str) -> None:
    sem = Lock(primary, "promoted", lease=30, prefix=scale_prefix, min_replicas=1)
    held = sem.attempt("task-1")
    assert isinstance(held, Permit)
    replica.execute_command("REPLICAOF", "NO", "ONE")
    after = Lock(replica, "promoted", lease=30, prefix=scale_prefix)
    assert after.attempt("task-2") == Waiting("task-2", "promoted", 0, 0)
    (holder,) = after.holders()
    assert (holder.permit_id, holder.token) == ("task-1", held.token)
    assert after.release(held)
    fresh = after.attempt("task-2")
    assert isinstance(fresh, Permit)
    assert fresh.token > held.token, "fencing tokens keep increasing after a failover"


def test_scripts_flushed_on_the_primary_are_reloaded_inside_the_pipeline(
    replicated, primary, scale_prefix
):
    sem = FairSemaphore(primary, "flushed", 1, prefix=scale_prefix, min_replicas=1)
    primary.script_flush()
    assert isinstance(sem.attempt("task-1"), Permit)
    assert on_replica(replicated, scale_prefix, "flushed", "task-1")


def test_bad_replica_options_are_configuration_errors(redis_client):
    with pytest.raises(ConfigurationError, match="min_replicas"):
        FairSemaphore(redis_client, "x", 1, min_replicas=-1)
    with pytest.raises(ConfigurationError, match="min_replicas"):
        FairSemaphore(redis_client, "x", 1, min_replicas=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="replica_timeout"):
        FairSemaphore(redis_client, "x", 1, min_replicas=1, replica_timeout=0)


@pytest.mark.parametrize(
    ("min_replicas", "outcome"),
    [(1, "SUCCESS"), (2, "FAILURE")],
)
def test_celery_tasks_take_min_replicas_from_the_settings(
    replicated, scale_prefix, min_replicas, outcome
):
    # The primary has one replica: a task asking for one acknowledgement runs; a task asking
    # for two is retried (NotEnoughReplicas is a BackendError) until its wait budget is spent,
    # then fails saying why, and no grant is left behind.
    app = make_app(
        replicated.primary.url,
        scale_prefix,
        redsem_min_replicas=min_replicas,
        redsem_replica_timeout=0.2,
        redsem_max_wait=1.0,
    )
    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            result = app.tasks["t.locked"].delay("acked-task")
            if outcome == "SUCCESS":
                assert result.get(timeout=15)["name"] == "locked:acked-task"
            else:
                with pytest.raises(BackendError, match=r"min_replicas=2 .* 1 replica"):
                    result.get(timeout=15)
            assert result.state == outcome
        state = read_state(get_client(app), "locked:acked-task", prefix=scale_prefix)
        assert state.holders == []
        assert state.waiters == []
    finally:
        close_app(app)


def test_a_replica_timeout_the_socket_timeout_cannot_wait_for_is_refused(redis_url):
    # WAIT blocks for replica_timeout; a socket timeout first would leave the grant held.
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        with pytest.raises(ConfigurationError, match=r"replica_timeout=3\.0s does not fit"):
            Lock(client, "x", min_replicas=1, replica_timeout=3)
        Lock(client, "x", min_replicas=1, replica_timeout=0.5)  # fits
        Lock(client, "x", replica_timeout=3)  # no WAIT without min_replicas: nothing to fit
    finally:
        client.close()
