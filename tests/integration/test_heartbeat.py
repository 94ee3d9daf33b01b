"""The heartbeat thread against a real server: keeps leases, detects loss, survives outages."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from celery_redsem import FairSemaphore, PermitLost
from celery_redsem.core.heartbeat import Heartbeat, HeldPermit, LeaseInterrupt, get_heartbeat
from tests.integration.conftest import true_in_forked_child
from tests.servers import embedded_valkey, wait_until


@pytest.fixture
def heartbeat() -> Iterator[Heartbeat]:
    beat = Heartbeat()
    yield beat
    beat.stop()


def _held(
    client: redis.Redis, prefix: str, lease: float = 0.3, **kw: object
) -> tuple[FairSemaphore, HeldPermit]:
    sem = FairSemaphore(client, "hb", 1, lease=lease, prefix=prefix)
    permit = sem.acquire()
    assert permit is not None
    return sem, HeldPermit(permit, client, **kw)  # type: ignore[arg-type]


def test_keeps_a_permit_alive_over_many_leases(
    redis_client: redis.Redis, prefix: str, heartbeat: Heartbeat
) -> None:
    sem, held = _held(redis_client, prefix)
    heartbeat.track(held)
    seen: set[int] = set()

    def refreshed_six_times() -> bool:
        seen.add(held.expires_at)
        assert not held.lost
        assert [h.permit_id for h in sem.state().holders] == [held.id]
        return len(seen) >= 7

    wait_until(refreshed_six_times, 5, interval=0.05, what="six refreshes")  # ~2 s = 6+ leases
    assert held.token == held.permit.token  # the grant never changed
    heartbeat.untrack(held)
    assert sem.release(held.permit)


def test_a_permit_taken_away_is_reported_lost(
    redis_client: redis.Redis, prefix: str, heartbeat: Heartbeat, caplog: pytest.LogCaptureFixture
) -> None:
    sem, held = _held(redis_client, prefix)
    heartbeat.track(held)
    assert sem.release(held.id)  # force-released by id, as an operator would
    wait_until(lambda: held.lost, 3, what="loss noticed")
    # Logged by the heartbeat thread just after it flags the loss.
    wait_until(lambda: "lost its lease" in caplog.text, 3, what="loss logged")
    with pytest.raises(PermitLost):
        held.check()
    assert held not in heartbeat.held()


class _PausedWhenIdle(Heartbeat):
    """A heartbeat whose thread stops, once, just after a look that found nothing to refresh:
    where a thread switch can come between that look and the thread going to sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = threading.Event()
        self.resume = threading.Event()

    def beat(self) -> float:
        wait = super().beat()
        if not self.held() and not self.paused.is_set():
            self.paused.set()
            self.resume.wait(5)
        return wait


def test_a_permit_tracked_while_the_thread_looks_is_refreshed_in_time(
    redis_client: redis.Redis, prefix: str
) -> None:
    heartbeat = _PausedWhenIdle()
    try:
        _, first = _held(redis_client, f"{prefix}:1", lease=30)
        heartbeat.track(first)  # starts the thread
        heartbeat.untrack(first)  # its next look finds nothing: it would sleep 30 s
        heartbeat._wake.set()  # look now (it may have seen `first` and gone to sleep for it)
        assert heartbeat.paused.wait(5)
        sem, held = _held(redis_client, f"{prefix}:2", lease=0.3)
        granted_until = held.expires_at
        heartbeat.track(held)  # a task starts while the thread is between looking and sleeping
        heartbeat.resume.set()
        wait_until(lambda: held.expires_at > granted_until, 2, what="a refresh")
        assert not held.lost
        assert [h.permit_id for h in sem.state().holders] == [held.id]
    finally:
        heartbeat.resume.set()
        heartbeat.stop()


def test_a_refresh_in_flight_after_untrack_is_not_a_loss(
    redis_client: redis.Redis, prefix: str, heartbeat: Heartbeat
) -> None:
    sem, held = _held(redis_client, prefix, lease=30)
    heartbeat.track(held)
    heartbeat.untrack(held)  # the task ends: stop refreshing, then release
    assert sem.release(held.permit)
    heartbeat._refresh([held], held.client)  # a refresh that was already on its way
    assert not held.lost


def test_raise_policy_interrupts_the_running_thread(
    redis_client: redis.Redis, prefix: str, heartbeat: Heartbeat
) -> None:
    sem, held = _held(redis_client, prefix, lost_lease_policy="raise")
    outcome: list[str] = []
    armed = threading.Event()

    def body() -> None:
        try:  # (armed inside the try: the interrupt may come at any step after it)
            held.arm()
            armed.set()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)
            outcome.append("ran to the end")
        except LeaseInterrupt:
            outcome.append("interrupted")
        finally:
            held.disarm()

    thread = threading.Thread(target=body)
    thread.start()
    assert armed.wait(5), "the body never armed its interrupt"
    heartbeat.track(held)
    sem.release(held.id)
    thread.join(10)
    assert outcome == ["interrupted"]


def test_outages_are_retried_and_a_real_expiry_is_loss(prefix: str, heartbeat: Heartbeat) -> None:
    with embedded_valkey() as url:
        client = redis.Redis.from_url(url, socket_timeout=0.1)
        admin = redis.Redis.from_url(url)
        _sem, held = _held(client, prefix, lease=1.5)
        heartbeat.track(held)
        admin.execute_command("CLIENT", "PAUSE", "600", "WRITE")  # refreshes time out for 0.6 s
        first = held.expires_at
        wait_until(lambda: held.expires_at > first + 600, 5, what="refreshed after the pause")
        assert not held.lost
        admin.close()
    # the server is gone: after a whole lease without a refresh the permit counts as lost
    wait_until(lambda: held.lost, 6, what="declared lost")
    # It can be declared lost while a refresh is still out (a whole lease unanswered): closing
    # the client under that call would fail it on a closed socket, logged as an error. (Its
    # port may by then be another test's server, which answers NOSCRIPT: the call goes on.)
    wait_until(lambda: not heartbeat._in_flight, 6, what="no refresh out")
    client.close()


def test_a_forked_child_starts_without_heartbeat_or_permits(
    redis_client: redis.Redis, prefix: str
) -> None:
    sem, held = _held(redis_client, prefix, lease=30)
    parent = get_heartbeat()
    parent.track(held)

    def child_starts_afresh() -> bool:
        child = get_heartbeat()
        return child is not parent and child.held() == []

    fresh = true_in_forked_child(child_starts_afresh)
    parent.untrack(held)
    sem.release(held.permit)
    assert fresh
