"""A run's wait for its permit: the wait header written and read in one place, the in-slot wait."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from celery.app.task import Context

from celery_redsem import FairSemaphore, Permit, Waiting
from celery_redsem.integration.line import attempt, wait_in_slot
from celery_redsem.integration.wire import (
    WAIT_HEADER,
    WaitState,
    headers_with_wait,
    read_wait,
    stamp_wait,
)
from tests.servers import wait_until


@pytest.fixture
def short_timeout_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client whose socket timeout (0.5 s) is within a short lease's lease/3."""
    client = redis.Redis.from_url(redis_url, socket_timeout=0.5)
    yield client
    client.close()


def test_a_wait_in_the_slot_outlasting_the_socket_timeout_is_no_redis_failure(
    short_timeout_client: redis.Redis, prefix: str
) -> None:
    # Each look for the wake-up ends within the socket timeout: a 1.5 s wait on a client
    # with socket_timeout=0.5 is a wait, not a "could not reach Redis" (BackendError).
    sem = FairSemaphore(short_timeout_client, "slot", 1, lease=5, prefix=prefix)
    blocker = sem.acquire(permit_id="blocker")
    assert blocker is not None
    first = attempt(sem, "run", waiter_lease=5)
    assert isinstance(first, Waiting)
    result = wait_in_slot(sem, "run", first, waiter_lease=5, seconds=1.5, hold=None)
    assert isinstance(result, Waiting)  # nobody released: still waiting, no error

    woken: list[Permit | Waiting] = []
    waiter = threading.Thread(
        target=lambda: woken.append(
            wait_in_slot(sem, "run", first, waiter_lease=5, seconds=10, hold=None)
        )
    )
    waiter.start()
    assert sem.release(blocker)  # the release wakes it
    waiter.join(10)
    wait_until(lambda: woken, 1, what="the waiter's result")
    assert isinstance(woken[0], Permit)
    assert woken[0].id == "run"


def test_the_wait_header_round_trips_through_a_retry_and_through_admission() -> None:
    wait = WaitState(attempts=3, first_ms=1000, errors=1, due_ms=2000, offline_ms=50)
    request = Context({"id": "t", "retries": 2, "headers": {"other": 1}})
    headers = headers_with_wait(request, wait)
    assert headers["other"] == 1
    assert read_wait(Context({"id": "t", "retries": 2, "headers": headers})) == wait
    # The task's own retry since: a fresh wait.
    assert read_wait(Context({"id": "t", "retries": 3, "headers": headers})) == WaitState()
    request_dict: dict[str, object] = {"id": "t", "retries": 2, "headers": {}}
    stamp_wait(request_dict, wait)
    assert request_dict[WAIT_HEADER] == headers[WAIT_HEADER]
    assert read_wait(Context(request_dict)) == wait
