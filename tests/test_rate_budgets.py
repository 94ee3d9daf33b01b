"""Budgets on the core rate limiter against a real server: a cost per start, several windows
checked and consumed together, units charged after the fact; sync and asyncio side by side."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import redis
import redis.asyncio

from celery_redsem import ConfigurationError, RateLimiter
from celery_redsem.asyncio import RateLimiter as AsyncRateLimiter
from celery_redsem.core.keys import SemaphoreKeys
from tests.servers import server_us, wait_until


def test_a_start_takes_its_cost_and_the_next_waits_for_it(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "c", "10/s", burst=10, prefix=prefix)
    assert limiter.attempt(cost=10)  # the whole burst at once: 1 s of the rate
    before = server_us(redis_client)
    refused = limiter.attempt(cost=5)
    after = server_us(redis_client)
    tat = limiter.state().tat_us
    assert tat is not None
    # Five units fit once the TAT is at most 10 - 5 units (0.5 s) ahead of the attempt.
    assert not refused.admitted
    assert before <= tat - 500_000 - round(refused.retry_after * 1e6) <= after
    assert limiter.attempt(cost=1).retry_after < refused.retry_after  # one unit waits less


def test_bookings_with_costs_are_spaced_by_their_costs(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "c", "10/s", burst=8, prefix=prefix)
    began = time.monotonic()  # (the waits count from the server's time of a's admission)
    assert limiter.attempt("a", cost=8, book=True)
    b = limiter.attempt("b", cost=8, book=True)  # free once the 8 units drained: 0.8 s
    # c's 2 units fit once b's 8 (booked from 0.8 s to 1.6 s) are 6 from draining: 1.0 s.
    c = limiter.attempt("c", cost=2, book=True)
    elapsed = time.monotonic() - began
    assert (b.booked, c.booked) == (True, True)
    assert 0.8 - elapsed - 0.001 <= b.retry_after <= 0.8
    assert 1.0 - elapsed - 0.001 <= c.retry_after <= 1.0
    time.sleep(c.retry_after)
    assert limiter.attempt("b", cost=8, book=True)
    # c's slot came, but b's actual admission (late, at c's slot) holds the units it took.
    late = limiter.attempt("c", cost=2, book=True)
    assert (late.admitted, late.booked) == (False, True)
    time.sleep(late.retry_after)
    assert limiter.attempt("c", cost=2, book=True)


@pytest.mark.parametrize("cost", [9, 0, -1, 2.5, True, "3"])
def test_a_cost_no_start_can_take_fails_at_once_writing_nothing(
    redis_client: redis.Redis, prefix: str, cost: object
) -> None:
    limiter = RateLimiter(redis_client, "big", ["100/s", "1000/m"], burst=[8, 50], prefix=prefix)
    keys = SemaphoreKeys(prefix, "big")
    with pytest.raises(ConfigurationError, match=r"cost of rate limiter 'big' .* from 1 to 8"):
        limiter.attempt("a", cost=cost, book=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="cost"):
        limiter.wait(1, cost=cost)  # type: ignore[arg-type]
    assert not redis_client.exists(keys.rate, keys.rate_line)
    if cost == 9:
        with pytest.raises(ConfigurationError, match="raise the burst"):
            limiter.attempt(cost=9)


def _tats(client: redis.Redis, keys: SemaphoreKeys) -> list[object]:
    """Both TATs of both windows, as stored (a refusal writes none of them)."""
    return client.hmget(keys.rate, "tat", "atat", "tat:2", "atat:2")


def test_a_refusal_by_one_window_consumes_none_of_the_others(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "w", ["2/s", "3/m"], prefix=prefix)
    keys = SemaphoreKeys(prefix, "w")
    assert [w.burst for w in limiter.windows] == [1, 3]  # the minute's budget, at 2/s
    assert limiter.attempt()
    first = _tats(redis_client, keys)
    assert limiter.state().windows[1].remaining == 2
    # Refused by the seconds window: the minute's budget is untouched.
    refused = limiter.attempt()
    assert not refused.admitted
    assert 0 < refused.retry_after <= 0.5
    assert _tats(redis_client, keys) == first
    limiter.admit(timeout=2)
    limiter.admit(timeout=2)
    assert limiter.state().windows[1].remaining == 0
    # Refused by the minute window (its units come back at 20 s each) once the seconds
    # window is free again: the refusal consumes none of it.
    wait_until(lambda: limiter.state().windows[0].tat_us is None, 3, what="a free second")
    before = _tats(redis_client, keys)
    refused = limiter.attempt()
    assert not refused.admitted
    assert 15 < refused.retry_after <= 20
    assert _tats(redis_client, keys) == before
    assert not limiter.wait(1)  # that far ahead nothing is booked
    assert limiter.state().booked == 0
    assert _tats(redis_client, keys) == before


def test_units_charged_after_the_fact_delay_later_starts(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "tokens", ["10/s", "100/m"], burst=[1, 100], prefix=prefix)
    began = time.monotonic()
    assert limiter.attempt()
    limiter.charge(5, charge_id="call-1")
    limiter.charge(5, charge_id="call-1")  # the same charge again (a retried call): once
    state = limiter.state()
    assert [w.remaining for w in state.windows] == [0, 94]
    refused = limiter.attempt()
    elapsed = time.monotonic() - began
    # One unit taken and five charged: the next start waits for six intervals of 0.1 s, less
    # the time since the first start (the test's own calls).
    assert 0.6 - elapsed - 0.001 <= refused.retry_after <= 0.6
    limiter.charge(1000)  # more than a window's burst may be charged: it only waits longer
    assert limiter.attempt().retry_after > 500
    with pytest.raises(ConfigurationError, match="units charged"):
        limiter.charge(0)


def test_the_budgets_hold_across_many_clients_with_costs(redis_url: str, prefix: str) -> None:
    """Eight threads with their own clients take random costs from one limiter of two windows:
    on the server's clock, units admitted in any half second stay within the first window's
    burst + 0.5 s of its rate, and the hour's budget is never overspent."""
    rate, burst, budget = 200.0, 5, 150
    admitted: list[tuple[int, int]] = []
    lock = threading.Lock()
    stop = time.monotonic() + 5  # (or once the hour's budget refuses)

    def hammer(seed: int) -> None:
        client = redis.Redis.from_url(redis_url)
        limiter = RateLimiter(
            client, "hot", [rate, f"{budget}/h"], burst=[burst, budget], prefix=prefix
        )
        pick = random.Random(seed)
        while time.monotonic() < stop:
            cost = pick.randint(1, burst)
            result = limiter.attempt(cost=cost)
            if result:
                seconds, micros = client.time()
                with lock:
                    admitted.append((seconds * 1_000_000 + micros, cost))
            elif result.retry_after > 10:
                break  # the hour's budget has less than this cost left
        client.close()

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted.sort()
    for i, (start, _) in enumerate(admitted):
        units = sum(cost for at, cost in admitted[i:] if at - start < 500_000)
        assert units <= burst + 0.5 * rate + burst  # (the TIME read comes a moment later)
    total = sum(cost for _, cost in admitted)
    assert budget - burst < total <= budget  # the hour's budget is used, and no more


def test_keys_of_several_windows_share_a_hash_tag_and_expire(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "idle", ["100/s", "20/m"], prefix=prefix, keep=0.1)
    assert limiter.attempt("a", cost=1)
    keys = SemaphoreKeys(prefix, "idle")
    # The minute window's TAT, one unit (3 s) after the attempt, bounds the TTL.
    assert 0 < redis_client.pttl(keys.rate) <= 3000
    assert 0 < redis_client.pttl(keys.rate_line) <= 3100


@pytest.mark.parametrize(
    ("rate", "burst", "match"),
    [
        (["10/s", "10/w"], None, r"rate limiter 'r': rate must be .*'10/w'"),
        (["10/s", "100/d"], [1], "burst has 1 entries for 2 rates"),
        (["10/s"] * 17, None, "1 to 16 rates"),
        ([], None, "1 to 16 rates"),
        (["10/s", "100/d"], [1, 0], r"burst of '100/d' must be"),
        ("1/d", 400, "spans more than"),
    ],
)
def test_bad_windows_name_what_is_wrong(
    redis_client: redis.Redis, prefix: str, rate: object, burst: object, match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        RateLimiter(redis_client, "r", rate, burst=burst, prefix=prefix)  # type: ignore[arg-type]


def test_asyncio_callers_share_the_budget_of_sync_ones(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    sync = RateLimiter(redis_client, "shared", ["10/s", "50/m"], burst=[10, 50], prefix=prefix)
    assert sync.attempt(cost=10)

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            limiter = AsyncRateLimiter(
                client, "shared", ["10/s", "50/m"], burst=[10, 50], prefix=prefix
            )
            refused = await limiter.attempt(cost=5)
            assert not refused.admitted
            assert 0 < refused.retry_after <= 0.5
            await limiter.admit(timeout=1, cost=5)
            await limiter.charge(20)
            state = await limiter.state()
            assert [w.remaining for w in state.windows][1] == 50 - 10 - 5 - 20
            with pytest.raises(ConfigurationError, match="from 1 to 10"):
                await limiter.attempt(cost=11)
            assert not await limiter.wait(0.05, cost=10)
        finally:
            await client.aclose()

    asyncio.run(main())
    assert [w.remaining for w in sync.state().windows][1] == 15


def test_a_paused_limiter_admits_and_books_nobody_until_it_ends(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "p", "1/m", burst=5, prefix=prefix)
    other = RateLimiter(redis_client, "q", "1/m", burst=5, prefix=prefix)
    assert limiter.attempt("before")
    assert limiter.pause(1.5) == 1.5
    assert limiter.pause(0.1) > 0.5  # a shorter pause leaves the longer one
    keys = SemaphoreKeys(prefix, "p")
    assert 0 < redis_client.pttl(keys.pause) <= 1500
    for refused in (
        limiter.attempt(),
        limiter.attempt("a", book=True),
        limiter.attempt("b", reserve=True),
    ):
        assert (refused.admitted, refused.booked, refused.paused) == (False, False, True)
        assert 0 < refused.retry_after <= 1.5
    assert limiter.state().booked == 0
    assert 0 < limiter.state().paused <= 1.5
    assert other.attempt()  # other names are untouched
    limiter.charge(1)  # a charge goes through a pause
    assert [w.remaining for w in limiter.state().windows] == [3]
    assert not limiter.wait(0.1)  # the pause ends later than that
    started = time.monotonic()
    assert limiter.wait(3)  # slept through the pause
    assert time.monotonic() - started < 2.5
    assert limiter.state().paused == 0
    # Expired: PTTL says 0 in the key's last millisecond, when it still exists.
    wait_until(lambda: not redis_client.exists(keys.pause), 1, what="the pause key to expire")


def test_resume_ends_a_pause_and_forget_takes_a_new_unit(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "p", "1/s", burst=2, prefix=prefix)
    assert limiter.attempt("run-1")
    assert limiter.attempt("run-1")  # idempotent: no second unit
    assert [w.remaining for w in limiter.state().windows] == [1]
    limiter.pause(60, forget="run-1")  # its call was refused: it must ask again
    assert limiter.attempt("run-1").paused
    limiter.resume()
    limiter.resume()  # nothing to end: nothing happens
    assert limiter.attempt("run-1")  # a new unit this time
    assert [w.remaining for w in limiter.state().windows] == [0]
    with pytest.raises(ConfigurationError, match="pause seconds"):
        limiter.pause(-1)


def test_asyncio_callers_pause_and_resume_the_same_limiter(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    sync = RateLimiter(redis_client, "ap", "100/s", prefix=prefix)

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            limiter = AsyncRateLimiter(client, "ap", "100/s", prefix=prefix)
            assert await limiter.pause(30) == 30
            assert sync.attempt().paused
            assert (await limiter.attempt()).paused
            assert (await limiter.state()).paused > 29
            await limiter.resume()
            assert await limiter.attempt()
            await limiter.pause(0.1)
            assert await limiter.wait(1)  # slept through it
        finally:
            await client.aclose()

    asyncio.run(main())
    assert sync.state().paused == 0
