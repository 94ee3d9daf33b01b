"""A hung server costs no permits on a healthy one, and its own holder learns of the loss
within about a lease (issue 20, item 2). The hung server is a real one stopped with SIGSTOP:
connections to it open, requests are sent, and no reply ever comes (a black hole)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import redis

from celery_redsem import Lock, Permit
from celery_redsem.core.heartbeat import MAX_REFRESHERS, Heartbeat, HeldPermit
from tests.servers import ServerProcess, server_process, wait_until

LEASE = 1.5


@contextmanager
def stopped(server: ServerProcess) -> Iterator[None]:
    """``server`` frozen with SIGSTOP (it keeps its sockets: calls to it hang) until exit."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def holds_for(seconds: float, check: Callable[[], None], *, interval: float = 0.05) -> None:
    """Run ``check`` (which asserts) again and again for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        check()
        time.sleep(interval)


def _granted(lock: Lock) -> Permit:
    permit = lock.acquire()
    assert isinstance(permit, Permit)
    return permit


def test_a_hung_client_never_delays_the_refreshes_of_another(
    redis_client: redis.Redis, prefix: str
) -> None:
    heartbeat = Heartbeat()
    with server_process(tag="hung") as far_server:
        # No socket timeout: a call to the stopped server never returns.
        far_client = far_server.client(socket_timeout=None)
        far_lock = Lock(far_client, "far", lease=LEASE, prefix=prefix)
        near_lock = Lock(redis_client, "near", lease=LEASE, prefix=prefix)
        rival = Lock(redis_client, "near", lease=LEASE, prefix=prefix)
        try:
            far = heartbeat.track(HeldPermit(_granted(far_lock), far_client))
            with stopped(far_server):
                near = heartbeat.track(HeldPermit(_granted(near_lock), redis_client))
                tracked_at = time.monotonic()

                def near_still_held() -> None:
                    assert not near.lost
                    assert rival.acquire() is None  # nobody else gets the healthy permit

                # Three leases: without a refresh the healthy permit would expire twice over.
                holds_for(3 * LEASE, near_still_held)
                assert far.lost  # its refresh never answered: lost, told within about a lease
                assert far.lost_error().permit_id == far.id
                refreshers = [t for t in threading.enumerate() if t.name == "redsem-refresh"]
                assert len(refreshers) <= MAX_REFRESHERS
            assert near.expires_at > near_lock.state().now_ms  # and refreshed all along
            assert time.monotonic() - tracked_at >= 3 * LEASE
        finally:
            heartbeat.stop()
            far_client.close()


def test_the_holder_on_a_hung_server_is_told_within_about_a_lease(prefix: str) -> None:
    heartbeat = Heartbeat()
    with server_process(tag="hung") as server:
        client = server.client(socket_timeout=None)
        try:
            held = HeldPermit(_granted(Lock(client, "far", lease=LEASE, prefix=prefix)), client)
            with stopped(server):
                heartbeat.track(held)
                confirmed = time.monotonic()  # tracked just after the grant: its confirmation
                wait_until(lambda: held.lost, 2 * LEASE, interval=0.01, what="the loss")
                told_after = time.monotonic() - confirmed
            # A lease after the last confirmation, plus the scheduler's slack (lease / 6).
            assert told_after < LEASE * 1.3, told_after
        finally:
            heartbeat.stop()
            client.close()


def test_refreshes_refused_at_once_back_off_instead_of_spinning(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A server out of memory refuses every refresh at once (OOM): the heartbeat waits 50 ms,
    # then doubles (up to a sixth of the lease) instead of calling again on every beat.
    heartbeat = Heartbeat()
    with server_process(tag="oom") as server:
        client = server.client()
        held = HeldPermit(_granted(Lock(client, "oom", lease=6.0, prefix=prefix)), client)
        client.config_set("maxmemory", 1)
        try:
            with caplog.at_level(logging.WARNING, logger="celery_redsem.core.heartbeat"):
                tracked = time.monotonic()
                heartbeat.track(held)

                def failures() -> int:
                    messages = [r.getMessage() for r in caplog.records]
                    return sum("refreshing 1 permit(s) failed" in m for m in messages)

                wait_until(lambda: failures() >= 5, 10, what="five failed refreshes")
                took = time.monotonic() - tracked
                assert "maxmemory" in caplog.text  # (refused at once: out of memory)
            # Due a third of a lease after the grant (less the scheduler's slack of a sixth),
            # then 50, 100, 200 and 400 ms apart.
            assert took >= 6.0 / 3 - 6.0 / 6 + 0.05 + 0.1 + 0.2 + 0.4 - 0.05, took
            assert failures() <= 7  # (the two beats that may log while this test looks)
        finally:
            heartbeat.stop()
            client.config_set("maxmemory", 0)
            client.close()


def test_the_back_off_stays_at_its_cap_after_any_number_of_failures() -> None:
    permit = Permit("p", "n", 1, 0, 6.0)
    held = HeldPermit(permit, redis.Redis(), clock=lambda: 100.0)
    held._failures = 5000  # (2 ** 5000 x 50 ms would overflow a float)
    held._failed(100.0)
    assert held._next_due == pytest.approx(100.0 + 6.0 / 6)
    assert held._due(100.5, slack=1.0) is False  # a retry is not pulled forward by the slack
    assert held._due(101.0, slack=1.0) is True
