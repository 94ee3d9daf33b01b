"""Blocking waits never outlast a short socket timeout (issue 20, item 5).

A timed-out BLPOP is answered on the server's next tick (up to ``1 / hz`` late), so a wait
capped only 0.1 s under the socket timeout can see its reply arrive after the client gave up.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redsem import FairSemaphore, Permit
from celery_redsem.core.client import (
    MIN_BLOCKING_MARGIN,
    blocking_wait_cap,
    pop_within,
    server_tick,
    socket_timeout,
)
from celery_redsem.core.connections import check_out
from tests.servers import embedded_valkey, wait_until

ACQUIRERS = 18
HOLD = 0.1  # seconds each acquirer keeps the permit
FIRST_HOLD = 1.2  # seconds the first holder keeps it once all 18 wait


@pytest.fixture(scope="module")
def slow_tick_url() -> Iterator[str]:
    """A server ticking once a second (``hz 1``): a timed-out BLPOP is up to 1 s late."""
    with embedded_valkey(hz=1) as url:
        yield url


def _line_up(url: str, prefix: str, socket_timeout: float) -> list[BaseException]:
    """18 acquirers block on a limit-1 semaphore held by the test, then take turns; the
    errors they met. No retries: redis-py would hide a socket timeout by sending again."""
    client = redis.Redis.from_url(url, socket_timeout=socket_timeout, retry=Retry(NoBackoff(), 0))
    admin = redis.Redis.from_url(url)
    sem = FairSemaphore(client, "line", 1, lease=30, prefix=prefix)
    first = sem.acquire()
    assert isinstance(first, Permit)
    errors: list[BaseException] = []
    served = threading.Semaphore(0)

    def acquirer() -> None:
        try:
            permit = sem.acquire(blocking=True, timeout=60)
            assert isinstance(permit, Permit)
            served.acquire(timeout=HOLD)  # hold it a moment (nothing releases this)
            sem.release(permit)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=acquirer) for _ in range(ACQUIRERS)]
    try:
        for thread in threads:
            thread.start()
        watch = FairSemaphore(admin, "line", 1, prefix=prefix)
        wait_until(lambda: len(watch.waiters()) == ACQUIRERS, 10, what="the line to form")
        # The holder works a while, and the server has nothing else to do: the blocked waits
        # time out, answered on the server's tick (a busy server answers sooner).
        threading.Event().wait(FIRST_HOLD)
        sem.release(first)
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        client.close()
        admin.close()
    return errors


@pytest.mark.parametrize("socket_timeout", [0.3, 0.5])
def test_blocked_acquirers_meet_no_socket_timeout(
    redis_url: str, prefix: str, socket_timeout: float
) -> None:
    assert _line_up(redis_url, prefix, socket_timeout) == []


def test_a_slow_ticking_server_is_polled_not_blocked_on(slow_tick_url: str, prefix: str) -> None:
    assert _line_up(slow_tick_url, prefix, 0.5) == []
    client = redis.Redis.from_url(slow_tick_url, socket_timeout=0.5)
    try:
        assert server_tick(client) == 1.0
        assert blocking_wait_cap(client) == 0.0  # no BLPOP fits in 0.5 s: poll instead
    finally:
        client.close()


def test_the_cap_leaves_a_tick_and_slack_below_the_socket_timeout(redis_url: str) -> None:
    for timeout, fits in [(0.3, True), (0.5, True), (5.0, True), (0.2, False)]:
        client = redis.Redis.from_url(redis_url, socket_timeout=timeout)
        try:
            cap = blocking_wait_cap(client)
            assert (cap > 0) == fits
            if fits:
                assert cap <= timeout - max(MIN_BLOCKING_MARGIN, server_tick(client))
        finally:
            client.close()
    unlimited = redis.Redis.from_url(redis_url, socket_timeout=None)
    assert blocking_wait_cap(unlimited) == math.inf
    unlimited.close()


def test_pop_within_without_room_to_block_still_takes_what_is_there(
    redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    client = redis.Redis.from_url(redis_url, socket_timeout=0.2)
    try:
        assert blocking_wait_cap(client) == 0.0
        key = f"{prefix}:list"
        assert pop_within(client, key, 0.1) is None
        redis_client.rpush(key, b"wake")
        assert pop_within(client, key, 0.1) == b"wake"
    finally:
        client.close()


def test_a_client_given_no_socket_timeout_has_its_connections_default(redis_url: str) -> None:
    # redis-py 8 gives connections a 5 s socket timeout that the client's options do not
    # show: read as none, it let a blocking wait be cut short by it.
    client = redis.Redis.from_url(redis_url)
    connection = check_out(client.connection_pool)  # (redis-py < 5.3 wants a command name)
    try:
        assert socket_timeout(client) == connection.socket_timeout
        if connection.socket_timeout:
            assert blocking_wait_cap(client) < connection.socket_timeout
    finally:
        client.connection_pool.release(connection)
        client.close()


def test_a_blocking_acquire_waits_past_the_default_socket_timeout(
    redis_url: str, prefix: str
) -> None:
    client = redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 0))
    connection = check_out(client.connection_pool)  # (redis-py < 5.3 wants a command name)
    default = connection.socket_timeout  # (what the connections use, whatever the client says)
    client.connection_pool.release(connection)
    if default is None:
        pytest.skip("this redis-py gives connections no socket timeout by default")
    sem = FairSemaphore(client, "past-default", 1, lease=30, prefix=prefix)
    held = sem.acquire()
    assert isinstance(held, Permit)
    try:
        started = time.monotonic()
        assert sem.acquire(blocking=True, timeout=default + 0.5) is None  # timed out, no error
        assert time.monotonic() - started >= default + 0.5
    finally:
        sem.release(held)
        client.close()
