"""Absurd durations and counts are refused before anything reaches Redis, and a script refuses
them too before it writes: a call that fails half way must not poison a name (issue 20 item 6).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redsem import ConfigurationError, FairSemaphore, Lock, Permit, PermitLost, Waiting
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.scripts import ACQUIRE, REFRESH
from celery_redsem.core.semaphore_spec import back_in_seconds as _back_in
from celery_redsem.core.validation import MAX_COUNT, MAX_SECONDS, SECONDS_OR_ZERO

ABSURD = [1e16, float(sys.maxsize), sys.maxsize]
COMMON_LUA = Path(__file__).parent.parent / "celery_redsem" / "core" / "lua" / "_common.lua"


def keys_of(client: redis.Redis, prefix: str) -> dict[bytes, Any]:
    """Every key under ``prefix`` with its contents and whether it has a TTL."""
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(match=f"{prefix}:*"):
        kind = client.type(key)
        if kind == b"hash":
            value: Any = client.hgetall(key)
        elif kind == b"zset":
            value = client.zrange(key, 0, -1, withscores=True)
        else:
            value = client.lrange(key, 0, -1)
        out[key] = (value, client.pttl(key) > 0)
    return out


@pytest.mark.parametrize("value", ABSURD)
@pytest.mark.parametrize("option", ["lease", "idle_ttl", "waiter_lease", "replica_timeout"])
def test_an_absurd_duration_is_refused_up_front(redis_client, prefix, option, value):
    with pytest.raises(ConfigurationError, match=option):
        FairSemaphore(redis_client, "sem", 2, prefix=prefix, **{option: value})
    with pytest.raises(ConfigurationError, match=option):
        Lock(redis_client, "lock", prefix=prefix, **{option: value})
    assert keys_of(redis_client, prefix) == {}


@pytest.mark.parametrize("value", ABSURD)
def test_an_absurd_wait_in_attempt_is_refused_up_front(redis_client, prefix, value):
    sem = FairSemaphore(redis_client, "sem", 1, prefix=prefix)
    with pytest.raises(ConfigurationError, match="waiter_lease"):
        sem.attempt("w", join_line=True, waiter_lease=value)
    with pytest.raises(ConfigurationError, match="back_in"):
        sem.attempt("w", join_line=True, waiter_lease=MAX_SECONDS, back_in=value)
    assert keys_of(redis_client, prefix) == {}


@pytest.mark.parametrize("limit", [10**30, MAX_COUNT + 1, sys.maxsize])
def test_an_absurd_limit_is_refused_up_front(redis_client, prefix, limit):
    with pytest.raises(ConfigurationError, match="limit"):
        FairSemaphore(redis_client, "sem", limit, prefix=prefix)
    assert keys_of(redis_client, prefix) == {}


def test_the_bounds_themselves_work_end_to_end(redis_client, prefix):
    sem = FairSemaphore(
        redis_client,
        "sem",
        MAX_COUNT,
        prefix=prefix,
        lease=MAX_SECONDS,
        waiter_lease=MAX_SECONDS,
        idle_ttl=MAX_SECONDS,
    )
    permit = sem.acquire(permit_id="a")
    assert isinstance(permit, Permit)
    state = sem.state()
    assert state.limit == MAX_COUNT
    assert [h.permit_id for h in state.holders] == ["a"]
    assert state.holders[0].token == permit.token
    assert all(has_ttl for _, has_ttl in keys_of(redis_client, prefix).values())
    lock = Lock(redis_client, "lock", prefix=prefix, lease=MAX_SECONDS, waiter_lease=MAX_SECONDS)
    assert isinstance(lock.acquire(permit_id="x"), Permit)
    place = lock.attempt("y", join_line=True, back_in=MAX_SECONDS - 1)
    assert isinstance(place, Waiting)
    assert place.position == 1
    assert sem.release(permit) is True
    assert lock.release("x") is True
    assert lock.release("y") is True


def test_back_in_is_checked_by_the_validation_rule():
    for value in [True, "1", float("nan"), -1, float("inf"), 1e16, MAX_SECONDS + 1]:
        with pytest.raises(ConfigurationError) as caught:
            _back_in(value, 1e17)
        assert SECONDS_OR_ZERO.expected in str(caught.value)
    assert _back_in(2, 10.0) == 2.0
    with pytest.raises(ConfigurationError, match="shorter than the waiter lease"):
        _back_in(10, 10.0)


def test_the_scripts_bounds_are_the_validation_modules():
    text = COMMON_LUA.read_text(encoding="utf-8")
    found = re.search(r"^local MAX_MS, MAX_COUNT = (\d+), (\d+)$", text, re.MULTILINE)
    assert found, "_common.lua no longer declares MAX_MS, MAX_COUNT"
    assert int(found[1]) == round(MAX_SECONDS * 1000)
    assert int(found[2]) == MAX_COUNT


def _settings(
    limit: int = 1, lease: int = 5000, waiter: int = 5000, idle: int = 60000, back: int = 0
) -> str:
    return f"{limit}:{lease}:{waiter}:{idle}:1:{back}|"


BAD_SETTINGS = {
    "lease": _settings(lease=10**19),
    "lease sys.maxsize s": _settings(lease=sys.maxsize * 1000),
    "idle ttl": _settings(idle=10**19),
    "waiter lease": _settings(waiter=10**19),
    "back in": _settings(back=10**20),
    "limit": _settings(limit=10**30),
    "limit 0": _settings(limit=0),
    "malformed": "1:5000:x:60000:1:0|",
}


@pytest.mark.parametrize("settings", BAD_SETTINGS.values(), ids=BAD_SETTINGS.keys())
def test_acquire_script_refuses_bad_settings_before_writing(redis_client, prefix, settings):
    """Past the Python checks, acquire.lua itself writes nothing when a setting is out of
    bounds, on an unused name and on one with a holder (renewing) and a waiter."""
    fresh = SemaphoreKeys(prefix, "fresh").holders
    with pytest.raises(redis.ResponseError):
        ACQUIRE(redis_client, [fresh], [settings + "a"])
    assert keys_of(redis_client, prefix) == {}

    used = SemaphoreKeys(prefix, "used").holders
    assert isinstance(ACQUIRE(redis_client, [used], [_settings() + "a"]), bytes)
    assert ACQUIRE(redis_client, [used], [_settings() + "b"])[0] == 1
    before = keys_of(redis_client, prefix)
    for permit_id in ["a", "b", "c"]:  # the holder, the waiter, a newcomer
        with pytest.raises(redis.ResponseError):
            ACQUIRE(redis_client, [used], [settings + permit_id])
        assert keys_of(redis_client, prefix) == before
    sem = FairSemaphore(redis_client, "used", 1, prefix=prefix, lease=5)
    assert [h.permit_id for h in sem.holders()] == ["a"]
    assert [w.permit_id for w in sem.waiters()] == ["b"]
    assert sem.release("a") is True
    assert isinstance(sem.attempt("b", join_line=True), Permit)


def test_refresh_script_refuses_a_bad_lease_before_refreshing_any(redis_client, prefix):
    sem = FairSemaphore(redis_client, "sem", 2, prefix=prefix, lease=5)
    first, second = sem.acquire(permit_id="a"), sem.acquire(permit_id="b")
    assert isinstance(first, Permit)
    assert isinstance(second, Permit)
    before = keys_of(redis_client, prefix)
    holders = sem.keys.holders
    for idle_ms, bad_lease in [(60000, 10**19), (10**19, 5000)]:
        args = [idle_ms, "a", str(first.token), 5000, "b", str(second.token), bad_lease]
        with pytest.raises(redis.ResponseError):
            REFRESH(redis_client, [holders, holders], args)
        assert keys_of(redis_client, prefix) == before
    refreshed = sem.refresh(first)
    assert refreshed.expires_at >= first.expires_at


def test_an_unreadable_holder_entry_counts_as_expired(redis_client, prefix):
    """A name poisoned by scripts that stored an overflowed expiry stays readable: the entry
    is shown nowhere, refreshing it reports it lost, and its holder's next call drops it."""
    sem = FairSemaphore(redis_client, "sem", 2, prefix=prefix, lease=5)
    live = sem.acquire(permit_id="a")
    assert isinstance(live, Permit)
    token = live.token + 1
    redis_client.hset(sem.keys.holders, "x", f"{token}:-9223372036854775808")
    assert [h.permit_id for h in sem.holders()] == ["a"]
    poisoned = Permit("x", "sem", token, live.expires_at, 5.0, prefix)
    with pytest.raises(PermitLost):
        sem.refresh(poisoned)
    assert not redis_client.hexists(sem.keys.holders, "x")
    redis_client.hset(sem.keys.holders, "x", f"{token}:-9223372036854775808")
    assert isinstance(sem.attempt("x"), Permit)  # its holder asks again: a new grant
    assert sem.refresh(live).id == "a"
