"""The core semaphore on a real server: grants, FIFO line, leases, fencing, refresh, release."""

from __future__ import annotations

import os
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from celery_redsem import (
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    FairSemaphore,
    Lock,
    Permit,
    PermitLost,
    Waiting,
    refresh_permits,
)
from celery_redsem.core.heartbeat import get_heartbeat
from celery_redsem.core.keys import SemaphoreKeys
from tests.servers import ENV_URL, ServerProcess, wait_until


def make(client: redis.Redis, prefix: str, limit: int = 2, **kwargs: float) -> FairSemaphore:
    return FairSemaphore(client, "sem", limit, prefix=prefix, **kwargs)  # type: ignore[arg-type]


def test_grants_up_to_the_limit_then_refuses(redis_client, prefix):
    sem = make(redis_client, prefix, limit=3)
    permits = [sem.acquire() for _ in range(3)]
    assert all(isinstance(p, Permit) for p in permits)
    assert sem.acquire() is None
    assert len(sem.holders()) == 3
    assert sem.release(permits[0]) is True
    assert isinstance(sem.acquire(), Permit)


def test_permit_carries_id_name_token_and_server_expiry(redis_client, prefix):
    sem = make(redis_client, prefix, lease=5)
    permit = sem.acquire(permit_id="task-1")
    assert permit is not None
    server_ms = int(redis_client.time()[0]) * 1000
    assert (permit.id, permit.name, permit.prefix) == ("task-1", "sem", prefix)
    assert server_ms + 3000 < permit.expires_at <= server_ms + 7000
    assert permit.token > 0


def test_lock_is_a_semaphore_of_one(redis_client, prefix):
    lock = Lock(redis_client, "report:7", prefix=prefix, lease=5)
    first = lock.acquire()
    assert first is not None
    assert lock.acquire() is None
    lock.release(first)
    second = lock.acquire()
    assert second is not None
    assert second.token > first.token


def test_waiters_are_served_in_ticket_order(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=5)
    holder = sem.acquire()
    assert holder is not None
    places = [sem.attempt(f"w{i}", join_line=True) for i in range(3)]
    assert [p.position for p in places if isinstance(p, Waiting)] == [1, 2, 3]
    sem.release(holder)
    # The free permit belongs to w0: later waiters and newcomers cannot take it.
    assert isinstance(sem.attempt("w2", join_line=True), Waiting)
    assert sem.acquire() is None
    w0 = sem.attempt("w0", join_line=True)
    assert isinstance(w0, Permit)
    sem.release(w0)
    assert isinstance(sem.attempt("w1", join_line=True), Permit)
    assert [w.permit_id for w in sem.waiters()] == ["w2"]


def test_a_waiter_keeps_its_place_when_it_asks_again(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=5)
    assert sem.acquire() is not None
    sem.attempt("first", join_line=True)
    sem.attempt("second", join_line=True)
    again = sem.attempt("first", join_line=True)
    assert isinstance(again, Waiting)
    assert again.position == 1
    assert [w.ticket for w in sem.waiters()] == [1, 2]


def test_a_waiter_that_does_not_come_back_drops_out_of_line(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=5)
    holder = sem.acquire()
    assert holder is not None
    sem.attempt("gone", join_line=True, waiter_lease=0.2)
    sem.attempt("stays", join_line=True, waiter_lease=30)
    sem.release(holder)
    wait_until(
        lambda: isinstance(sem.attempt("stays", join_line=True, waiter_lease=30), Permit),
        timeout=3,
        what="the live waiter to move past the dead one",
    )
    assert [w.permit_id for w in sem.waiters()] == []


def test_a_waiter_whose_place_lapsed_rejoins_behind_the_live_line(redis_client, prefix):
    # Nothing swept the lapsed place yet (the semaphore was not full): coming back, it is a
    # newcomer, and the free permit goes to the live, due waiter that was behind it.
    sem = make(redis_client, prefix, limit=2, lease=30)
    sem.attempt("h1")
    second = sem.attempt("h2")
    assert isinstance(second, Permit)
    assert sem.attempt("lapsed", join_line=True, waiter_lease=0.2).position == 1
    assert sem.attempt("live", join_line=True, waiter_lease=30).position == 2
    sem.release(second)  # one permit free, owed to "lapsed" while its place lasts
    expires = max(w.expires_at for w in sem.waiters() if w.permit_id == "lapsed")
    wait_until(lambda: server_ms(redis_client) > expires, timeout=5, what="the place to lapse")
    back = sem.attempt("lapsed", join_line=True, waiter_lease=30)
    assert isinstance(back, Waiting)
    assert back.position == 2
    assert isinstance(sem.attempt("live", join_line=True, waiter_lease=30), Permit)
    assert [w.permit_id for w in sem.waiters()] == ["lapsed"]


def test_holder_asking_again_gets_the_same_permit(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=5)
    first = sem.acquire(permit_id="task-9")
    again = sem.acquire(permit_id="task-9")
    assert first is not None
    assert again is not None
    assert again.token == first.token
    assert again.expires_at >= first.expires_at
    assert len(sem.holders()) == 1


def test_a_crashed_holder_frees_its_permit_when_the_lease_ends(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.2)
    assert sem.acquire() is not None  # never released: the holder "crashed"
    assert sem.acquire() is None
    assert wait_until(sem.acquire, timeout=3, what="the expired lease to free the permit")


def test_fencing_tokens_increase_also_after_keys_expired(redis_client, prefix):
    sem = make(redis_client, prefix, limit=2, lease=0.1, idle_ttl=0.1)
    tokens = []
    for _ in range(5):
        permit = sem.acquire()
        assert permit is not None
        tokens.append(permit.token)
        sem.release(permit)
    wait_until(
        lambda: not list(redis_client.scan_iter(match=f"{prefix}:*")),
        timeout=3,
        what="keys to expire",
    )
    after_idle = sem.acquire()
    assert after_idle is not None
    tokens.append(after_idle.token)
    assert tokens == sorted(set(tokens))


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_refresh_extends_a_held_permit(redis_client, prefix):
    sem = make(redis_client, prefix, lease=1.0)  # refreshed every 50 ms
    first = sem.acquire()
    assert first is not None
    permit = first

    def refreshed_past_the_first_lease() -> bool:
        nonlocal permit
        permit = sem.refresh(permit)
        return server_ms(redis_client) > first.expires_at + 300

    wait_until(refreshed_past_the_first_lease, timeout=5, interval=0.05, what="time to pass")
    assert permit.expires_at > first.expires_at
    assert [(h.permit_id, h.token) for h in sem.holders()] == [(first.id, first.token)]


def test_refresh_never_resurrects_an_expired_permit(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.15)
    permit = sem.acquire()
    assert permit is not None
    wait_until(lambda: not sem.holders(), timeout=3, what="the lease to expire")
    result = refresh_permits(redis_client, [permit])
    assert result.lost == [permit]
    assert result.refreshed == []
    assert sem.holders() == []
    assert redis_client.hget(sem.keys.holders, permit.id) is None


def test_refresh_of_a_released_permit_reports_it_lost(redis_client, prefix):
    sem = make(redis_client, prefix)
    permit = sem.acquire()
    assert permit is not None
    sem.release(permit)
    with pytest.raises(Exception, match="lost"):
        sem.refresh(permit)
    assert sem.holders() == []


def test_a_refresh_of_an_earlier_grant_leaves_a_later_grant_of_the_id_alone(redis_client, prefix):
    # The id was granted again (as a task run's id is after a redelivery): refreshing the
    # first grant neither renews the second nor writes its own token over it.
    sem = make(redis_client, prefix, limit=1, lease=30)
    first = sem.acquire(permit_id="run-1")
    assert first is not None
    assert sem.release(first)
    second = sem.acquire(permit_id="run-1")
    assert second is not None
    with pytest.raises(PermitLost):
        sem.refresh(first)
    assert refresh_permits(redis_client, [first]).lost == [first]
    (held,) = sem.holders()
    assert (held.permit_id, held.token, held.expires_at) == (
        "run-1",
        second.token,
        second.expires_at,
    )


def test_refreshes_keep_the_holders_hash_alive_past_its_first_ttl(redis_client, prefix):
    sem = make(redis_client, prefix, lease=0.6, idle_ttl=0.2)  # the hash outlives a lease by 0.2 s
    first = sem.acquire()
    assert first is not None
    permit = first

    def refreshed_past_the_first_ttl() -> bool:
        nonlocal permit
        permit = sem.refresh(permit)  # PermitLost if the hash expired under it
        return server_ms(redis_client) > first.expires_at + 500

    wait_until(refreshed_past_the_first_ttl, timeout=5, interval=0.05, what="time to pass")
    assert [h.permit_id for h in sem.holders()] == [first.id]
    assert redis_client.pttl(sem.keys.holders) > 0


def test_batched_refresh_reports_each_lost_permit(redis_client, prefix):
    a = FairSemaphore(redis_client, "a", 2, prefix=prefix, lease=5)
    b = FairSemaphore(redis_client, "b", 2, prefix=prefix, lease=5)
    kept_a, gone_a, kept_b = a.acquire(), a.acquire(), b.acquire()
    assert kept_a is not None
    assert gone_a is not None
    assert kept_b is not None
    a.release(gone_a)
    result = refresh_permits(redis_client, [kept_a, gone_a, kept_b])
    assert [p.id for p in result.refreshed] == [kept_a.id, kept_b.id]
    assert [p.id for p in result.lost] == [gone_a.id]


def test_callers_with_different_limits_each_count_against_their_own(redis_client, prefix):
    # As the quickstart documents for two tasks that share a key with different limits.
    low = FairSemaphore(redis_client, "shared", 2, prefix=prefix)
    high = FairSemaphore(redis_client, "shared", 5, prefix=prefix)
    assert low.acquire() is not None
    assert low.acquire() is not None
    assert low.acquire() is None  # 2 hold it: the limit-2 caller waits
    assert high.acquire() is not None  # the limit-5 caller still gets in
    assert low.state().limit == 5  # the limit of the last caller that asked
    assert low.acquire() is None
    assert low.state().limit == 2
    assert len(low.holders()) == 3


def test_release_is_idempotent(redis_client, prefix):
    sem = make(redis_client, prefix)
    permit = sem.acquire()
    assert permit is not None
    assert sem.release(permit) is True
    assert sem.release(permit) is False
    assert sem.release(permit.id) is False


def test_release_of_an_old_grant_does_not_free_the_new_one(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.15)
    old = sem.acquire(permit_id="task-1")
    assert old is not None
    wait_until(lambda: not sem.holders(), timeout=3, what="the first grant to expire")
    new = sem.acquire(permit_id="task-1")  # the same task id, redelivered, gets a new grant
    assert new is not None
    assert new.token > old.token
    assert sem.release(old) is False
    assert [h.token for h in sem.holders()] == [new.token]


def test_release_of_an_old_grant_leaves_the_same_ids_place_in_line(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.15)
    old = sem.acquire(permit_id="task-1")
    assert old is not None
    wait_until(lambda: not sem.holders(), timeout=3, what="the first grant to expire")
    assert sem.acquire(permit_id="task-2") is not None  # someone else holds it now
    waiting = sem.attempt("task-1", join_line=True, waiter_lease=5)  # task-1, redelivered
    assert isinstance(waiting, Waiting)
    assert sem.release(old) is False  # the stalled first run ends: nothing of its to give back
    assert [w.permit_id for w in sem.state().waiters] == ["task-1"]


def test_release_by_id_frees_whatever_the_id_holds(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=5)
    assert sem.acquire(permit_id="task-1") is not None
    sem.attempt("task-2", join_line=True)
    assert sem.release("task-1") is True
    assert sem.release("task-2") is True  # leaves the line
    assert sem.state().holders == []
    assert sem.state().waiters == []


# The scripts take the permit id in one argument with the settings ('<settings>|<id>') or the
# token ('<token>:<id>'): ids that contain those separators, or look like a token, must
# still name exactly themselves.
@pytest.mark.parametrize("pid", ["a|b|", "7:8", "12:", "x:1|2:3", "ünï cødé\nline", "9" * 40])
def test_permit_ids_with_separators_name_exactly_themselves(redis_client, prefix, pid):
    sem = make(redis_client, prefix, limit=2, lease=5)
    permit = sem.acquire(permit_id=pid)
    assert permit is not None
    assert permit.id == pid
    renewed = sem.acquire(permit_id=pid)  # idempotent: the same grant back
    assert renewed == permit._replace(expires_at=sem.holders()[0].expires_at)
    assert [h.permit_id for h in sem.holders()] == [pid]
    assert sem.release(permit._replace(token=permit.token - 1)) is False  # another grant's token
    assert sem.release(permit._replace(id=pid + "x")) is False
    assert sem.release(permit) is True
    assert sem.holders() == []
    assert sem.acquire(permit_id=pid) is not None
    assert sem.release(pid) is True  # by id, as a worker's main process releases
    assert sem.state().holders == []


def test_an_idle_semaphore_leaves_no_key_behind(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.2, idle_ttl=0.2)
    held = sem.acquire()
    assert held is not None
    sem.attempt("waiter", join_line=True, waiter_lease=0.2)
    crashed = FairSemaphore(redis_client, "other", 1, prefix=prefix, lease=0.2, idle_ttl=0.2)
    assert crashed.acquire() is not None  # never released
    assert list(redis_client.scan_iter(match=f"{prefix}:*"))
    for key in redis_client.scan_iter(match=f"{prefix}:*"):
        assert redis_client.pttl(key) > 0, key
    wait_until(
        lambda: not list(redis_client.scan_iter(match=f"{prefix}:*")),
        timeout=5,
        what="every key of the idle semaphores to expire",
    )


def test_all_keys_of_a_semaphore_share_one_cluster_slot():
    keys = SemaphoreKeys("redsem", "market:42")
    slots = {key_slot(k.encode()) for k in [*keys.all, keys.wake("some-task-id")]}
    assert len(slots) == 1


def test_script_flush_does_not_break_callers(redis_client, prefix):
    if os.environ.get(ENV_URL):
        pytest.skip("SCRIPT FLUSH would empty the script cache of a server the tests share")
    sem = make(redis_client, prefix)
    permit = sem.acquire()
    assert permit is not None
    redis_client.script_flush()
    permit = sem.refresh(permit)
    assert sem.release(permit) is True
    assert sem.acquire() is not None


class FlushedAfterEachLoad(redis.Redis):
    """A real client whose script cache another client flushes right after each load."""

    def script_load(self, script):  # type: ignore[no-untyped-def]
        sha = super().script_load(script)
        other = redis.Redis(connection_pool=self.connection_pool)
        other.script_flush()
        return sha


def test_a_flush_between_loading_and_running_a_script_does_not_break_callers(redis_url, prefix):
    if os.environ.get(ENV_URL):
        pytest.skip("SCRIPT FLUSH would empty the script cache of a server the tests share")
    client = FlushedAfterEachLoad.from_url(redis_url)
    client.script_flush()
    sem = make(client, prefix)
    permit = sem.acquire()  # NOSCRIPT, load, NOSCRIPT again: run from source
    assert permit is not None
    assert sem.release(permit) is True
    client.close()


class CountingConnection(redis.Connection):
    """A real connection that counts the requests it writes to the socket."""

    sent = 0

    def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
        type(self).sent += 1
        super().send_packed_command(command, check_health)


def test_each_operation_is_one_round_trip(redis_url, prefix):
    client = redis.Redis.from_url(redis_url, connection_class=CountingConnection)
    client.ping()
    sem = make(client, prefix, limit=1)
    ops = (
        sem.acquire,
        lambda: sem.attempt("w", join_line=True),
        sem.state,
        lambda: sem.release("w"),
    )
    for op in ops:  # the first call of a script on a fresh server also loads it
        op()
    for op in ops:
        before = CountingConnection.sent
        op()
        assert CountingConnection.sent - before == 1
    permit = sem.state().holders[0]
    held = Permit(permit.permit_id, "sem", permit.token, permit.expires_at, 10.0, prefix)
    sem.refresh(held)  # may load refresh.lua
    before = CountingConnection.sent
    sem.refresh(held)
    sem.release(held)
    assert CountingConnection.sent - before == 2


def test_blocking_acquire_is_woken_by_a_release(redis_client, prefix):
    # The waiter lease is long, so only the wake-up (not polling) can hand over quickly.
    sem = make(redis_client, prefix, limit=1, lease=30, waiter_lease=30)
    holder = sem.acquire()
    assert holder is not None
    got: list[tuple[Permit | None, float]] = []
    waiter = threading.Thread(
        target=lambda: got.append((sem.acquire(blocking=True, timeout=20), 0))
    )
    waiter.start()
    wait_until(sem.waiters, timeout=3, what="the waiter to join the line")
    released_at = time.monotonic()
    sem.release(holder)
    waiter.join(timeout=8)
    assert got
    assert got[0][0] is not None
    assert time.monotonic() - released_at < 5  # woken: its poll alone would take 10 s


def test_blocking_acquire_times_out_and_leaves_the_line(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=30)
    assert sem.acquire() is not None
    started = time.monotonic()
    assert sem.acquire(blocking=True, timeout=0.3) is None
    assert 0.25 < time.monotonic() - started < 3
    assert sem.waiters() == []


def test_hold_releases_on_exit_and_raises_on_timeout(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=30)
    with sem.hold(timeout=1) as permit:
        assert [h.permit_id for h in sem.holders()] == [permit.id]
        with pytest.raises(AcquireTimeout, match="sem"), sem.hold(timeout=0.1):
            pass
    assert sem.holders() == []


def hold_past_the_lease(
    sem: FairSemaphore, client: redis.Redis, error: Exception | None = None
) -> None:
    """Hold a permit in ``sem.hold()`` until its lease ran out and somebody else took it; then
    leave the block normally, or by raising ``error``."""
    with sem.hold() as permit:
        wait_until(
            lambda: server_ms(client) > permit.expires_at, timeout=5, what="the lease to run out"
        )
        assert sem.acquire() is not None
        if error is not None:
            raise error


def test_hold_raises_permit_lost_when_the_lease_ran_out_in_the_block(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.3)
    with pytest.raises(PermitLost, match="lost before the block ended"):
        hold_past_the_lease(sem, redis_client)


def test_hold_does_not_hide_the_blocks_own_error_behind_permit_lost(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.3)
    with pytest.raises(KeyError, match="from the block"):
        hold_past_the_lease(sem, redis_client, KeyError("from the block"))


def test_hold_keep_alive_keeps_a_short_lease_for_a_long_block(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.6)
    with sem.hold(keep_alive=True) as permit:
        wait_until(
            lambda: server_ms(redis_client) > permit.expires_at + 1200,
            timeout=10,
            what="two leases to pass",
        )
        assert sem.acquire() is None  # still ours
        [holder] = sem.holders()
        assert (holder.permit_id, holder.token) == (permit.id, permit.token)
        assert holder.expires_at > permit.expires_at  # renewed
    assert sem.holders() == []
    assert get_heartbeat().held() == []  # the heartbeat stopped tracking it


def test_hold_keep_alive_raises_permit_lost_after_a_force_release(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=0.6)

    def force_released_in_the_block() -> None:
        with sem.hold(keep_alive=True) as permit:
            assert sem.release(permit.id)  # what an operator's force release does
            wait_until(lambda: sem.acquire() is not None, timeout=5, what="a new holder")

    with pytest.raises(PermitLost):
        force_released_in_the_block()


@pytest.mark.parametrize("timeout", [-1, -0.5, float("nan")])
def test_blocking_acquire_rejects_a_negative_timeout(redis_client, prefix, timeout):
    sem = make(redis_client, prefix, limit=1)
    with pytest.raises(ConfigurationError, match="timeout must be >= 0"):
        sem.acquire(blocking=True, timeout=timeout)
    with pytest.raises(ConfigurationError, match="timeout must be >= 0"), sem.hold(timeout):
        pass
    assert sem.holders() == []
    assert sem.waiters() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"limit": 0}, "limit must be an int >= 1"),
        ({"limit": -3}, "limit must be an int >= 1"),
        ({"limit": "5"}, "limit must be an int"),
        ({"limit": 2.5}, "limit must be an int"),
        ({"limit": True}, "limit must be an int"),
        ({"lease": 0}, "lease must be"),
        ({"lease": -1}, "lease must be"),
        ({"lease": float("nan")}, "lease must be"),
        ({"lease": "10"}, "lease must be"),
        ({"waiter_lease": 0}, "waiter_lease must be"),
        ({"name": ""}, "must not be empty"),
        ({"name": 42}, "must be a str"),
        ({"name": "a{b}"}, "hash tag"),
        ({"name": "x" * 600}, "maximum is 512"),
        ({"prefix": ""}, "prefix"),
        ({"prefix": "a*"}, "prefix"),
    ],
)
def test_bad_arguments_get_a_clear_error(redis_client, kwargs, message):
    args = {"name": "sem", "limit": 2, **kwargs}
    name, limit = args.pop("name"), args.pop("limit")
    with pytest.raises(ConfigurationError, match=message):
        FairSemaphore(redis_client, name, limit, **args)


def test_a_client_that_is_not_redis_is_refused():
    with pytest.raises(ConfigurationError, match=r"redis\.Redis"):
        FairSemaphore("redis://localhost", "sem", 2)  # type: ignore[arg-type]


def test_unreachable_redis_is_a_backend_error():
    no_retries = Retry(NoBackoff(), 0)
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=no_retries)
    sem = FairSemaphore(client, "sem", 2)
    with pytest.raises(Exception, match=r"Redis failed during acquire\.lua") as info:
        sem.acquire()
    assert type(info.value).__name__ == "BackendError"
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    assert info.value.transient  # a retry can succeed once the server is up


def test_a_refusal_is_a_backend_error_no_retry_can_fix(tmp_path):
    server = ServerProcess(["--requirepass", "right"], tmp_path, ping_kwargs={"password": "right"})
    server.start()
    try:
        no_retries = Retry(NoBackoff(), 0)  # redis-py retries a refused login by default
        wrong = FairSemaphore(server.client(password="wrong", retry=no_retries), "sem", 2)
        with pytest.raises(BackendError, match="invalid username-password") as info:
            wrong.acquire()
        assert not info.value.transient
        client = server.client(password="right")
        client.config_set("maxmemory", "1")  # every write is refused: out of memory
        with pytest.raises(BackendError, match="maxmemory") as full:
            FairSemaphore(client, "sem", 2).acquire()
        assert full.value.transient  # memory can free up
    finally:
        server.kill()


def test_a_client_with_decoded_responses_works_the_same(redis_url, prefix):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    sem = FairSemaphore(client, "sem", 1, prefix=prefix, lease=5)
    permit = sem.acquire(permit_id="task-1")
    assert permit is not None
    place = sem.attempt("task-2", join_line=True)
    assert isinstance(place, Waiting)
    assert place.position == 1
    assert [h.permit_id for h in sem.holders()] == ["task-1"]
    assert sem.refresh(permit).token == permit.token
    assert sem.release(permit) is True


def test_a_waiter_that_is_away_does_not_hold_a_free_permit(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=5)
    holder = sem.acquire()
    assert holder is not None
    away = sem.attempt("retrying-task", join_line=True, waiter_lease=60, back_in=30)
    assert isinstance(away, Waiting)
    sem.release(holder)
    present = sem.acquire()  # the waiter is away for 30 s: the permit is not left idle
    assert present is not None
    assert [w.permit_id for w in sem.waiters()] == ["retrying-task"]  # it keeps its place


def test_a_waiter_that_is_due_holds_the_next_permit(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=5)
    holder = sem.acquire()
    assert holder is not None
    sem.attempt("retrying-task", join_line=True, waiter_lease=30, back_in=0.2)
    due_at = server_ms(redis_client) + 200
    wait_until(lambda: server_ms(redis_client) > due_at, timeout=3, what="the waiter to be due")
    sem.release(holder)
    assert sem.acquire() is None  # a newcomer may not take the permit the due waiter is owed
    assert isinstance(sem.attempt("retrying-task", join_line=True), Permit)


def test_present_callers_are_served_in_line_order_past_an_absent_one(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=5)
    holder = sem.acquire()
    assert holder is not None
    sem.attempt("away", join_line=True, waiter_lease=60, back_in=30)
    sem.attempt("present", join_line=True, waiter_lease=60)
    sem.release(holder)
    assert sem.acquire() is None  # "present" is due and ahead of any newcomer
    assert isinstance(sem.attempt("present", join_line=True), Permit)
    assert [w.permit_id for w in sem.waiters()] == ["away"]


@pytest.mark.parametrize(
    ("back_in", "message"), [(-1, ">= 0"), (10, "shorter than"), ("1", "number")]
)
def test_bad_back_in_gets_a_clear_error(redis_client, prefix, back_in, message):
    sem = make(redis_client, prefix)
    with pytest.raises(ConfigurationError, match=message):
        sem.attempt("t", join_line=True, waiter_lease=10, back_in=back_in)


def test_renewing_with_a_shorter_lease_does_not_hide_the_expiry(redis_client, prefix):
    long_lease = FairSemaphore(redis_client, "sem", 1, prefix=prefix, lease=30)
    short_lease = FairSemaphore(redis_client, "sem", 1, prefix=prefix, lease=0.2)
    assert long_lease.acquire(permit_id="task-1") is not None
    assert short_lease.acquire(permit_id="task-1") is not None  # same grant, now 0.2 s
    wait_until(lambda: not short_lease.holders(), timeout=3, what="the short lease to end")
    assert short_lease.acquire() is not None  # the dead holder no longer counts


def test_a_line_that_outlived_its_holders_hash_keeps_its_order(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=30)
    holder = sem.acquire()
    assert holder is not None
    sem.attempt("first", join_line=True, waiter_lease=60)
    sem.attempt("second", join_line=True, waiter_lease=60)
    redis_client.delete(sem.keys.holders)  # e.g. evicted, or deleted by hand
    late = sem.attempt("late", join_line=True, waiter_lease=60)
    assert isinstance(late, Waiting)
    assert late.position == 3
    assert [w.permit_id for w in sem.waiters()] == ["first", "second", "late"]


def test_a_waiter_leaves_a_line_that_outlived_its_holders_hash(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=30)
    assert sem.acquire() is not None
    sem.attempt("first", join_line=True, waiter_lease=60)
    sem.attempt("second", join_line=True, waiter_lease=60)
    redis_client.delete(sem.keys.holders)  # e.g. evicted, or deleted by hand
    assert sem.release("first")  # gives up its place: the line does not wait for it
    assert [w.permit_id for w in sem.waiters()] == ["second"]
    assert isinstance(sem.attempt("second", join_line=True), Permit)
    assert redis_client.pttl(sem.keys.holders) > 0  # the hash came back with a TTL


def test_a_release_wakes_the_first_due_waiter_not_one_that_is_away(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=30, waiter_lease=30)  # polls every 10 s
    holder = sem.acquire()
    assert holder is not None
    sem.attempt("away", join_line=True, waiter_lease=60, back_in=30)
    got: list[Permit | None] = []
    waiter = threading.Thread(target=lambda: got.append(sem.acquire(blocking=True, timeout=20)))
    waiter.start()
    wait_until(lambda: len(sem.waiters()) == 2, timeout=3, what="the blocked waiter in line")
    released_at = time.monotonic()
    sem.release(holder)
    waiter.join(timeout=8)
    assert got
    assert got[0] is not None
    assert time.monotonic() - released_at < 5  # woken: its poll alone would take 10 s


def _woken(redis_client, sem):
    """The ids whose wake-up lists hold a wake-up now."""
    keys = redis_client.keys(sem.keys.wake("*"))
    return sorted(k.decode().rsplit(":", 1)[1] for k in keys)


@pytest.mark.parametrize("due_lost", [False, True])
def test_a_release_wakes_due_waiters_in_line_order_among_the_first_hundred_places(
    redis_client, prefix, due_lost
):
    # A deep line of waiters away on countdowns, with due ones among them: the release wakes
    # the first due ones in line order, and none past the hundredth place. With the due-times
    # key lost, every place counts as due (the wake-ups go to the first places).
    sem = make(redis_client, prefix, limit=3, lease=30)
    holders = [sem.acquire(permit_id=f"h{i}") for i in range(3)]
    present = {7, 42, 99, 100, 140}
    for i in range(150):
        back_in = 0.0 if i in present else 30.0
        sem.attempt(f"w{i:03d}", join_line=True, waiter_lease=60, back_in=back_in)
    if due_lost:
        redis_client.delete(sem.keys.waiter_due)
    assert _woken(redis_client, sem) == []
    assert sem.release(holders[0])
    assert _woken(redis_client, sem) == (["w000"] if due_lost else ["w007"])
    assert sem.release(holders[1])
    assert sem.release(holders[2])
    # (w007 was woken already; a wake-up list holds one wake-up)
    expected = ["w000", "w001", "w002"] if due_lost else ["w007", "w042", "w099"]
    assert _woken(redis_client, sem) == expected


def test_a_place_without_a_due_time_is_woken_when_a_stale_one_balances_the_count(
    redis_client, prefix
):
    # As many due times as places, but one belongs to a place gone and one place has none
    # (lost with a key, made again): the place without one counts as due, as it always did.
    sem = make(redis_client, prefix, limit=1, lease=30)
    holder = sem.acquire(permit_id="h")
    for i in range(5):
        sem.attempt(f"w{i}", join_line=True, waiter_lease=60, back_in=30)
    redis_client.zrem(sem.keys.waiter_due, "w3")
    redis_client.zadd(sem.keys.waiter_due, {"ghost": 1})  # due long ago, not in line
    assert redis_client.zcard(sem.keys.waiter_due) == redis_client.zcard(sem.keys.waiters)
    assert sem.release(holder)
    assert _woken(redis_client, sem) == ["w3"]


@pytest.mark.parametrize("lost", ["waiter_expiry", "waiter_due"])
def test_a_line_key_lost_and_made_again_gets_a_ttl(redis_client, prefix, lost):
    sem = make(redis_client, prefix, limit=1, lease=30)
    assert sem.acquire() is not None
    sem.attempt("first", join_line=True, waiter_lease=60)
    key = getattr(sem.keys, lost)
    redis_client.delete(key)  # e.g. evicted, or deleted by hand
    sem.attempt("second", join_line=True, waiter_lease=60)  # writes the key afresh
    assert redis_client.pttl(key) > 0  # not immortal


def test_places_whose_waiter_leases_were_lost_leave_the_line(redis_client, prefix):
    # With the waiter-expiry key gone, nothing says when those places end: they count as
    # lapsed, and a live waiter is not kept behind them while the permit is free.
    sem = make(redis_client, prefix, limit=1, lease=30)
    holder = sem.acquire()
    assert holder is not None
    sem.attempt("gone-1", join_line=True, waiter_lease=60)
    sem.attempt("gone-2", join_line=True, waiter_lease=60)
    redis_client.delete(sem.keys.waiter_expiry)
    assert sem.release(holder)
    assert [w.permit_id for w in sem.waiters()] == []
    assert isinstance(sem.attempt("alive", join_line=True, waiter_lease=60), Permit)


def test_due_times_of_places_lost_with_the_line_do_not_hold_permits(redis_client, prefix):
    # The line's order and waiter leases are lost (evicted, deleted) but its due times are
    # not: those are nobody's places, and must not keep a free permit from a newcomer.
    sem = make(redis_client, prefix, limit=2, lease=60, waiter_lease=60)
    first, second = sem.acquire(), sem.acquire()
    assert first is not None
    assert second is not None
    sem.attempt("ghost-1", join_line=True)
    sem.attempt("ghost-2", join_line=True)
    redis_client.delete(sem.keys.waiters, sem.keys.waiter_expiry)
    assert sem.release(first)
    assert sem.release(second)
    holder, last = sem.acquire(), sem.acquire()
    assert holder is not None
    assert last is not None
    assert isinstance(sem.attempt("away", join_line=True, back_in=50), Waiting)
    assert sem.release(last)  # one permit free; the only live waiter is away for 50 s
    assert isinstance(sem.attempt("newcomer"), Permit)
    assert redis_client.zrange(sem.keys.waiter_due, 0, -1) == [b"away"]


def test_a_waiter_that_keeps_asking_keeps_its_place_past_its_first_waiter_lease(
    redis_client, prefix
):
    sem = make(redis_client, prefix, limit=1, lease=30)
    assert sem.acquire() is not None
    first = sem.attempt("first", join_line=True, waiter_lease=0.5)
    assert isinstance(first, Waiting)
    assert isinstance(sem.attempt("second", join_line=True, waiter_lease=30), Waiting)

    def asked_again_past_the_first_waiter_lease() -> bool:
        again = sem.attempt("first", join_line=True, waiter_lease=0.5)  # renews the place
        assert again == Waiting("first", sem.name, 1, again.expires_at)
        return server_ms(redis_client) > first.expires_at + 300

    wait_until(asked_again_past_the_first_waiter_lease, 5, interval=0.1, what="time to pass")
    assert [w.permit_id for w in sem.waiters()] == ["first", "second"]


def test_a_waiter_whose_due_time_was_lost_is_not_jumped(redis_client, prefix):
    # Only the due times are lost (evicted, deleted): a place with none counts as due, since
    # its waiter may be blocked on a wake-up now, so a newcomer does not take its permit.
    sem = make(redis_client, prefix, limit=1, lease=30, waiter_lease=60)
    holder = sem.acquire()
    assert holder is not None
    assert isinstance(sem.attempt("first", join_line=True), Waiting)
    assert isinstance(sem.attempt("second", join_line=True, back_in=50), Waiting)
    redis_client.delete(sem.keys.waiter_due)
    assert isinstance(sem.attempt("second", join_line=True, back_in=50), Waiting)  # re-dated
    assert sem.release(holder)
    assert sem.attempt("newcomer") == Waiting("newcomer", sem.name, 0, 0)
    for _ in range(2):  # joins, then asks again: due itself, but behind "first"
        assert isinstance(sem.attempt("third", join_line=True), Waiting)
    # Dated once, for good: no later call walks the line to find undated places.
    due = redis_client.zrange(sem.keys.waiter_due, 0, -1)
    assert sorted(due) == sorted(redis_client.zrange(sem.keys.waiters, 0, -1))
    assert redis_client.pttl(sem.keys.waiter_due) > 0
    assert isinstance(sem.attempt("first", join_line=True), Permit)


def test_more_lapsed_places_than_one_sweep_batch_are_all_swept(redis_client, prefix):
    sem = make(redis_client, prefix, limit=1, lease=30)
    holder = sem.acquire()
    assert holder is not None
    for n in range(2500):  # 2.5 sweep batches of places that will lapse
        sem.attempt(f"w{n}", join_line=True, waiter_lease=2.0)
    expires = max(w.expires_at for w in sem.waiters())
    wait_until(lambda: server_ms(redis_client) > expires, timeout=5, what="the places to lapse")
    assert redis_client.zcard(sem.keys.waiters) > 2000  # still there: nothing swept them yet
    assert sem.release(holder)
    assert isinstance(sem.attempt("newcomer"), Permit)  # nobody live is ahead of it
    assert sem.waiters() == []


def test_a_renamed_semaphore_is_the_one_built_under_that_name(redis_client, prefix):
    settings = {"lease": 7.0, "idle_ttl": 60.0, "prefix": prefix}
    renamed = FairSemaphore(redis_client, "first", 3, **settings).renamed("second")
    built = FairSemaphore(redis_client, "second", 3, **settings)
    assert renamed.keys == built.keys
    assert renamed._key_args == built._key_args
    permit = renamed.acquire()
    assert permit is not None
    assert [h.permit_id for h in built.holders()] == [permit.id]
    assert built.release(permit)
    with pytest.raises(ConfigurationError, match="must not contain"):
        built.renamed("bad{name}")
