"""The core rate limiter (GCRA on the server's clock) against a real server."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, ClassVar

import pytest
import redis

from celery_redsem import BackendError, ConfigurationError, RateLimiter
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.rate_limit import parse_rate, read_rate_state
from celery_redsem.core.scripts import GCRA, run_script
from tests.servers import server_us, wait_until


@pytest.mark.parametrize(
    ("rate", "per_second"),
    [
        ("10/s", 10.0),
        ("120/m", 2.0),
        ("3600/h", 1.0),
        ("86400/d", 1.0),
        ("5", 5.0),
        (" 2 / s ", 2.0),
        (0.5, 0.5),
    ],
)
def test_rates_in_celerys_notation(rate: object, per_second: float) -> None:
    assert parse_rate(rate) == pytest.approx(per_second)


@pytest.mark.parametrize("rate", ["0/s", "-1/s", "10/w", "ten/s", "", True, None, float("nan"), 0])
def test_a_bad_rate_is_a_configuration_error(rate: object) -> None:
    with pytest.raises(ConfigurationError, match="rate must be"):
        parse_rate(rate)


def test_bad_arguments_are_configuration_errors(redis_client: redis.Redis, prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="burst"):
        RateLimiter(redis_client, "r", "1/s", burst=0, prefix=prefix)
    with pytest.raises(ConfigurationError, match="must not contain"):
        RateLimiter(redis_client, "a{b}", "1/s", prefix=prefix)
    limiter = RateLimiter(redis_client, "r", "1/s", prefix=prefix)
    with pytest.raises(ConfigurationError, match="permit_id"):
        limiter.attempt("x" * 300)
    with pytest.raises(ConfigurationError, match="needs a permit_id"):
        limiter.attempt(book=True)
    with pytest.raises(ConfigurationError, match="max_wait"):
        limiter.attempt("p", book=True, max_wait=-1)


def test_the_burst_is_admitted_then_the_exact_wait_is_told(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "r", "4/s", burst=3, prefix=prefix)
    started = time.monotonic()
    assert [bool(limiter.attempt()) for _ in range(4)] == [True, True, True, False]
    refused = limiter.attempt()
    elapsed = time.monotonic() - started  # (long on a loaded host)
    # The burst took its three slots at the first call: the next is free 0.25 s after it.
    assert 0.25 - elapsed - 0.001 <= refused.retry_after <= 0.25
    assert not refused.booked
    time.sleep(refused.retry_after)
    assert limiter.attempt()
    assert not limiter.attempt()


def test_bookings_are_served_first_come_first_served(
    redis_client: redis.Redis, prefix: str
) -> None:
    # 4/s: slots 0.25 s apart, so a loaded host's pause between two calls (50 ms
    # apart at 20/s) does not free the next slot before it is booked.
    limiter = RateLimiter(redis_client, "r", "4/s", prefix=prefix)
    assert limiter.attempt("first", book=True)
    booked, calls = [], []  # each call's answer, and when it was made (began, ended)
    for n in range(3):
        began = time.monotonic()
        booked.append(limiter.attempt(f"p{n}", book=True))
        calls.append((began, time.monotonic()))
    last_booked = calls[-1][0]  # (the server timed that booking no earlier than this)
    assert all(b.booked and not b.admitted for b in booked)
    waits = [b.retry_after for b in booked]
    # Each wait counts from its own call: on the client's clock the slots are 0.25 s apart,
    # within the time the two calls took (long on a loaded host).
    for (w1, (b1, e1)), (w2, (b2, e2)) in itertools.pairwise(zip(waits, calls, strict=True)):
        assert (w2 + b2) - (w1 + e1) - 0.001 <= 0.25 <= (w2 + e2) - (w1 + b1) + 0.001
    # A newcomer without a booking is told the slot after the booked ones, counted from the
    # newcomer's own call: at most the time since the last booking call began has passed.
    newcomer = limiter.attempt()
    since = time.monotonic() - last_booked
    assert waits[-1] + 0.25 - since - 0.001 <= newcomer.retry_after <= waits[-1] + 0.25 + 1e-6
    # Asking early keeps the booking; at its slot the booking admits, without racing anyone.
    again = limiter.attempt("p0", book=True)
    assert again.booked
    assert again.retry_after <= waits[0]
    time.sleep(again.retry_after)
    assert limiter.attempt("p0", book=True)
    assert limiter.attempt("p0")  # idempotent: admitted again, no second slot
    assert limiter.state().booked == 2


def test_a_slot_beyond_max_wait_is_not_booked(redis_client: redis.Redis, prefix: str) -> None:
    limiter = RateLimiter(redis_client, "r", "1/s", prefix=prefix)
    assert limiter.attempt("a", book=True)
    refused = limiter.attempt("b", book=True, max_wait=0.5)
    assert not refused.booked
    assert refused.retry_after > 0.5
    assert limiter.state().booked == 0
    assert not limiter.wait(0.5)


def test_wait_sleeps_until_the_slot(redis_client: redis.Redis, prefix: str) -> None:
    limiter = RateLimiter(redis_client, "r", "20/s", prefix=prefix)
    started = time.monotonic()
    for _ in range(5):
        limiter.admit(timeout=5)
    assert 0.19 <= time.monotonic() - started < 1.0


def test_the_rate_holds_across_many_clients(redis_url: str, prefix: str) -> None:
    """Eight threads with their own clients hammer one limiter: admissions on the server's
    clock never exceed burst + window x rate."""
    rate, burst, admitted = 50.0, 2, []
    lock = threading.Lock()
    stop = time.monotonic() + 1.0

    def hammer() -> None:
        client = redis.Redis.from_url(redis_url)
        limiter = RateLimiter(client, "hot", rate, burst=burst, prefix=prefix)
        while time.monotonic() < stop:
            if limiter.attempt():
                with lock:
                    admitted.append(client.time())
        client.close()

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times = sorted(s + us / 1e6 for s, us in admitted)
    for i, start in enumerate(times):
        in_window = sum(1 for t in times[i:] if t - start < 0.5)
        assert in_window <= burst + 0.5 * rate + 1  # the client's TIME comes a moment later
    assert len(times) >= 0.9 * rate  # and the rate is used


def test_keys_share_a_hash_tag_and_expire(redis_client: redis.Redis, prefix: str) -> None:
    limiter = RateLimiter(redis_client, "idle", "100/s", burst=2, prefix=prefix, keep=0.2)
    keys = SemaphoreKeys(prefix, "idle")
    assert limiter.attempt("a", book=True)
    assert limiter.attempt("b", book=True)
    assert {k.split("}")[0] for k in (keys.rate, keys.rate_line)} == {f"{prefix}:{{idle"}
    # Each has a TTL (-2: gone already, as a loaded host can take 20 ms to get here; -1 would
    # be a key that never expires).
    rate_ttl, line_ttl = redis_client.pttl(keys.rate), redis_client.pttl(keys.rate_line)
    assert rate_ttl == -2 or 0 < rate_ttl <= 20, rate_ttl
    assert line_ttl == -2 or 0 < line_ttl <= 220, line_ttl
    wait_until(lambda: not redis_client.exists(keys.rate, keys.rate_line), 3, what="keys gone")
    assert limiter.state().tat_us is None


def test_state_shows_rate_burst_and_next_free_time(redis_client: redis.Redis, prefix: str) -> None:
    limiter = RateLimiter(redis_client, "s", "2/s", burst=1, prefix=prefix)
    assert read_rate_state(redis_client, "s", prefix=prefix).rate is None
    limiter.attempt("a", book=True)
    limiter.attempt("b", book=True)
    state = read_rate_state(redis_client, "s", prefix=prefix)
    assert (state.rate, state.burst, state.booked, state.remembered) == (2.0, 1, 1, 2)
    assert 0.9 < state.next_free <= 1.0
    assert state.tat_us is not None
    assert state.tat_us > state.now_us


@pytest.mark.parametrize(
    "args",
    [
        [0, 0, 0, "", 1, 1, 0, 1],  # interval 0
        [0, 0, 0, "", 2, 1, 1000, 1],  # a cost above the burst
        [0, 0, 0, "", 1, 2, 1000, 1],  # a window missing
        [0, 0, 0, "", 1, 1, 10**9, 10**9],  # interval x burst beyond a year
        [0, 4, 0, "", 1, 1, 1000, 1],  # no such mode
    ],
)
def test_the_script_refuses_settings_out_of_bounds(
    redis_client: redis.Redis, prefix: str, args: list[object]
) -> None:
    keys = SemaphoreKeys(prefix, "bad")
    with pytest.raises(BackendError, match="out of bounds"):
        run_script(GCRA, redis_client, [keys.rate, keys.rate_line], args, "bad")
    assert not redis_client.exists(keys.rate, keys.rate_line)


def test_a_refused_attempt_is_told_exactly_when_it_may_run(
    redis_client: redis.Redis, prefix: str
) -> None:
    """``retry_after`` is the next free slot less the server time of the attempt itself: that
    time lies between two server readings taken around the call."""
    limiter = RateLimiter(redis_client, "r", "4/s", burst=2, prefix=prefix)
    assert limiter.attempt()
    assert limiter.attempt()
    before = server_us(redis_client)
    refused = limiter.attempt()
    after = server_us(redis_client)
    free_at = limiter.state().tat_us
    assert free_at is not None
    free_at -= 250_000  # burst 2: the next slot is one interval before the TAT
    assert not refused.admitted
    assert before <= free_at - round(refused.retry_after * 1e6) <= after


class _CountingConnection(redis.Connection):
    """A real connection that notes the name of every command it sends."""

    sent: ClassVar[list[str]] = []

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        name = args[0]
        self.sent.append((name.decode() if isinstance(name, bytes) else str(name)).upper())
        super().send_command(*args, **kwargs)


def test_one_script_call_and_one_round_trip_per_attempt(redis_url: str, prefix: str) -> None:
    """An attempt, admitted, refused, booked or reserved, sends one EVALSHA and nothing else."""
    pool = redis.ConnectionPool.from_url(redis_url, connection_class=_CountingConnection)
    client = redis.Redis(connection_pool=pool)
    try:
        limiter = RateLimiter(client, "r", "1/s", prefix=prefix)
        limiter.attempt("warm-up")  # connects (and loads the script on a new server)
        _CountingConnection.sent.clear()
        results = [
            limiter.attempt(),
            limiter.attempt("a", book=True),
            limiter.attempt("b", reserve=True),
            limiter.attempt("a", book=True),
        ]
        assert _CountingConnection.sent == ["EVALSHA"] * 4
    finally:
        client.close()
        pool.disconnect()
    assert [r.admitted for r in results] == [False] * 4
    assert [r.booked for r in results] == [False, True, True, True]


def test_a_reserved_slot_is_taken_by_its_id_only_and_counts_from_then(
    redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "r", "5/s", prefix=prefix)
    first = limiter.attempt("a", reserve=True)  # free now: kept for "a", nobody admitted
    assert (first.admitted, first.booked, first.retry_after) == (False, True, 0.0)
    assert not limiter.attempt()  # a newcomer finds the slot taken
    assert limiter.attempt("a")  # "a" takes it
    assert limiter.attempt("a", reserve=True)  # admitted before: again, no second slot
    # Two slots reserved, then both taken late at the same moment: the admissions are
    # spaced by the rate however late they come.
    later = [limiter.attempt(pid, reserve=True) for pid in ("b", "c")]
    assert [r.booked for r in later] == [True, True]
    wait_until(lambda: limiter.attempt("c", reserve=True).retry_after == 0, 2, what="c due")
    started = time.monotonic()
    assert limiter.attempt("b")
    late = limiter.attempt("c", book=True)
    elapsed = time.monotonic() - started  # (long on a loaded host)
    assert (late.admitted, late.booked) == (False, True)
    assert 0.2 - elapsed - 0.001 <= late.retry_after <= 0.2
    assert limiter.state().booked == 1
