"""The lane: acquire and release over one kept connection of the client's pool (lane.py)."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redsem import BackendError, FairSemaphore
from celery_redsem.core import lane
from celery_redsem.core.lane import Lane, executor_for, lane_of
from tests.servers import ServerProcess, server_process


@pytest.fixture
def named_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client whose connections carry a unique name (to find them in CLIENT LIST), and
    that never retries a failed command itself (so the lane's own handling is what shows)."""
    client = redis.Redis.from_url(
        redis_url, client_name=f"lane-{uuid.uuid4().hex[:8]}", retry=Retry(NoBackoff(), 0)
    )
    yield client
    client.close()


def _connections(admin: redis.Redis, name: str) -> list[dict[str, Any]]:
    return [c for c in admin.client_list() if c.get("name") == name]


def _kept_id(client: redis.Redis) -> int:
    """Server-side id of the connection the client's lane keeps."""
    found = lane_of(client)
    assert found is not None, "the client has no lane"
    assert found.kept is not None, "the lane keeps no connection yet"
    return int(found.kept.client_id())


def _pairs(sem: FairSemaphore, count: int) -> None:
    for _ in range(count):
        permit = sem.acquire()
        assert permit is not None
        assert sem.release(permit) is True


def test_acquire_and_release_go_over_one_kept_connection(
    named_client: redis.Redis, redis_client: redis.Redis, prefix: str
) -> None:
    name = named_client.connection_pool.connection_kwargs["client_name"]
    sem = FairSemaphore(named_client, "lane", 3, prefix=prefix)
    _pairs(sem, 2)  # (on a new server the scripts are loaded first)
    kept = _kept_id(named_client)
    _pairs(sem, 50)
    assert _kept_id(named_client) == kept
    by_id = {int(c["id"]): c for c in _connections(redis_client, name)}
    assert by_id[kept]["cmd"] == "client|id"  # _kept_id's own call, the last one on it
    # The pool keeps the connection it lent for the first call; the lane took it afterwards.
    assert len(by_id) <= 2
    # Another semaphore on the same client shares the lane rather than keeping a second one.
    other = FairSemaphore(named_client, "lane-2", 1, prefix=prefix)
    _pairs(other, 5)
    assert _kept_id(named_client) == kept
    assert len(_connections(redis_client, name)) <= 2


def test_a_connection_closed_while_idle_is_replaced_before_the_call(
    named_client: redis.Redis, redis_client: redis.Redis, prefix: str, monkeypatch: Any
) -> None:
    sem = FairSemaphore(named_client, "lane", 3, prefix=prefix)
    _pairs(sem, 2)
    old = _kept_id(named_client)
    redis_client.client_kill_filter(_id=old)
    monkeypatch.setattr(lane, "PROBE_AFTER_IDLE", 0.0)  # every call counts as after idle
    _pairs(sem, 3)
    assert _kept_id(named_client) != old


@pytest.mark.parametrize("retries", [0, 1])
def test_a_connection_that_breaks_between_calls_is_handled_by_the_retry_policy(
    retries: int, redis_url: str, redis_client: redis.Redis, prefix: str, monkeypatch: Any
) -> None:
    monkeypatch.setattr(lane, "PROBE_AFTER_IDLE", 3600.0)  # no probe: the call finds it closed
    client = redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), retries))
    sem = FairSemaphore(client, "lane", 3, prefix=prefix)
    _pairs(sem, 2)
    old = _kept_id(client)
    redis_client.client_kill_filter(_id=old)
    if retries:  # redis-py reconnects and sends it again, as it would on a pooled connection
        permit = sem.acquire()
        assert permit is not None
        assert sem.release(permit) is True
    else:  # no retry: the caller hears of it (Celery retries the task); nothing was granted
        with pytest.raises(BackendError, match="Connection closed by server"):
            sem.acquire()
    _pairs(sem, 2)
    assert _kept_id(client) != old  # the lane reconnected
    assert sem.holders() == []
    client.close()


def test_a_busy_lane_is_not_waited_for(named_client: redis.Redis, prefix: str) -> None:
    sem = FairSemaphore(named_client, "lane", 3, prefix=prefix)
    _pairs(sem, 2)
    found = lane_of(named_client)
    assert isinstance(found, Lane)
    with found._lock:  # another thread is mid-call on the lane
        done = threading.Event()
        worker = threading.Thread(target=lambda: (_pairs(sem, 3), done.set()))
        worker.start()
        assert done.wait(10), "a call waited for the busy lane instead of using the pool"
        worker.join()


def test_threads_sharing_a_client_keep_the_limit_and_their_own_replies(
    named_client: redis.Redis, prefix: str
) -> None:
    sem = FairSemaphore(named_client, "lane", 2, prefix=prefix)
    held = 0
    most = 0
    count_lock = threading.Lock()
    failures: list[BaseException] = []

    def run() -> None:
        nonlocal held, most
        try:
            for _ in range(150):
                permit = sem.acquire()
                if permit is None:
                    continue
                with count_lock:
                    held += 1
                    most = max(most, held)
                with count_lock:
                    held -= 1
                assert sem.release(permit) is True
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert 1 <= most <= 2
    assert sem.holders() == []


def _child_pairs(sem: FairSemaphore, client: redis.Redis, out: Any) -> None:
    _pairs(sem, 200)
    out.put(_kept_id(client))


def test_a_forked_child_keeps_its_own_connection_not_its_parents(
    named_client: redis.Redis, prefix: str
) -> None:
    sem = FairSemaphore(named_client, "lane", 3, prefix=prefix)
    _pairs(sem, 2)
    parent_kept = _kept_id(named_client)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_child_pairs, args=(sem, named_client, out))
    child.start()
    _pairs(sem, 200)  # at the same time as the child: a shared socket would mix the replies
    child.join(60)
    assert child.exitcode == 0
    child_kept = out.get(timeout=5)
    assert child_kept != parent_kept
    assert _kept_id(named_client) == parent_kept  # the child never closed the parent's socket
    assert sem.holders() == []


class _Subclass(redis.Redis):
    """A client subclass (it may override execute_command: the lane would bypass it)."""


@pytest.mark.parametrize(
    "make",
    [
        lambda url: _Subclass(connection_pool=redis.ConnectionPool.from_url(url)),
        lambda url: redis.Redis(
            connection_pool=redis.BlockingConnectionPool.from_url(url, max_connections=50)
        ),
        lambda url: redis.Redis.from_url(url, max_connections=lane.MIN_POOL_FOR_LANE - 1),
        lambda url: redis.Redis.from_url(url, single_connection_client=True),
    ],
    ids=["subclass", "blocking-pool", "small-pool", "single-connection"],
)
def test_clients_that_get_no_lane_are_used_as_they_are(
    make: Any, redis_url: str, prefix: str
) -> None:
    client = make(redis_url)
    try:
        assert executor_for(client) == client.execute_command
        sem = FairSemaphore(client, "lane", 1, prefix=prefix)
        _pairs(sem, 3)
        assert lane_of(client) is None
    finally:
        client.close()


def test_a_lane_does_not_keep_its_client_alive(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    sem = FairSemaphore(client, "lane", 1, prefix=prefix)
    _pairs(sem, 2)
    assert lane_of(client) is not None
    pool = client.connection_pool
    gone = weakref.ref(client)
    gc.disable()  # freed by reference counting alone: no cycle through the lane
    try:
        del sem, client
        assert gone() is None
    finally:
        gc.enable()
        pool.disconnect()


class _Interrupt(BaseException):
    """Raised into a call, as a Celery time limit or Ctrl-C would be."""


def test_a_call_interrupted_after_sending_leaves_no_reply_for_the_next(
    named_client: redis.Redis, prefix: str, monkeypatch: Any
) -> None:
    sem = FairSemaphore(named_client, "lane", 3, prefix=prefix)
    _pairs(sem, 2)
    found = lane_of(named_client)
    assert found is not None
    assert found.kept is not None

    def interrupted(*args: Any, **options: Any) -> Any:
        monkeypatch.undo()  # once
        raise _Interrupt

    # The command is sent; the exception lands before its reply is read.
    monkeypatch.setattr(found.kept, "parse_response", interrupted)
    with pytest.raises(_Interrupt):
        sem.acquire(permit_id="interrupted")
    for _ in range(5):
        permit = sem.acquire()
        assert permit is not None
        assert permit.id != "interrupted"
        assert sem.release(permit) is True
    # The interrupted acquire did run: its grant is there, to be given back by its id.
    assert [h.permit_id for h in sem.holders()] == ["interrupted"]
    assert sem.release("interrupted") is True


def test_clients_that_share_a_pool_share_one_lane(redis_url: str, prefix: str) -> None:
    pool = redis.ConnectionPool.from_url(redis_url, max_connections=lane.MIN_POOL_FOR_LANE)
    clients = [redis.Redis(connection_pool=pool) for _ in range(lane.MIN_POOL_FOR_LANE + 2)]
    for n, client in enumerate(clients):
        _pairs(FairSemaphore(client, f"lane-{n}", 1, prefix=prefix), 2)
    lanes = {id(lane_of(client)) for client in clients}
    assert len(lanes) == 1
    assert lane_of(clients[0]) is not None
    # The pool has connections to spare for everything else.
    assert all(client.ping() for client in clients)
    pool.disconnect()


def _semaphore_in_child(url: str, prefix: str, out: Any) -> None:
    _pairs(FairSemaphore(redis.Redis.from_url(url), "lane-child", 1, prefix=prefix), 2)
    out.put("done")


def test_a_child_forked_while_a_thread_was_finding_a_lane_can_make_semaphores(
    redis_url: str, prefix: str
) -> None:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    with lane._registry.lock:  # as if another thread were in executor_for at the fork
        child = context.Process(target=_semaphore_in_child, args=(redis_url, prefix, out))
        child.start()
    child.join(20)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
    assert out.get(timeout=5) == "done"


class _CountingConnection(redis.Connection):
    """Counts every attempt to open a socket."""

    attempts = 0

    def _connect(self) -> Any:
        type(self).attempts += 1
        return super()._connect()


def _attempts_to_fail(client: redis.Redis, server: ServerProcess, prefix: str) -> int:
    sem = FairSemaphore(client, "lane", 1, prefix=prefix)
    _pairs(sem, 3)
    server.stop()
    _CountingConnection.attempts = 0
    with pytest.raises(BackendError):
        sem.acquire()
    return _CountingConnection.attempts


def test_an_unreachable_server_costs_the_lane_no_more_attempts_than_the_pool(
    prefix: str,
) -> None:
    attempts = {}
    for kind, cls in (("pool", _Subclass), ("lane", redis.Redis)):  # (a subclass: no lane)
        with server_process(tag="lane") as server:
            pool = redis.ConnectionPool.from_url(
                server.url, connection_class=_CountingConnection, retry=Retry(NoBackoff(), 2)
            )
            client = cls(connection_pool=pool)
            attempts[kind] = _attempts_to_fail(client, server, prefix)
            assert (lane_of(client) is None) == (kind == "pool")
            pool.disconnect()
    assert attempts["pool"] >= 3  # redis-py's retries did run
    assert 1 <= attempts["lane"] <= attempts["pool"]
