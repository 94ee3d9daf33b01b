"""Admission's pipelined asks on a real server, driven by a real kombu event loop (the one a
Celery worker runs): answers in order, several asks in flight at once, a script the server lost,
a server that stops answering and a connection the server closes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from kombu.asynchronous import Hub

from celery_redsem import BackendError, FairSemaphore, Permit, Waiting
from celery_redsem.integration.admission.asks import (
    Answer,
    Asks,
    PipelinedAsks,
    WaitingAsks,
    asks_for,
)
from tests.servers import embedded_valkey


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop_hub = Hub()
    yield loop_hub
    loop_hub.close()


def run_until(hub: Hub, condition: Callable[[], bool], timeout: float) -> None:
    """Turn the event loop until ``condition`` holds; fail after ``timeout`` seconds."""
    loop = hub.create_loop()
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the event loop never got there"
        next(loop)


def ask(asks: Asks, sem: FairSemaphore, answers: list[Answer], *permit_ids: str) -> None:
    """Ask for each of ``permit_ids`` as a waiter that waits now; answers go to ``answers``."""
    for permit_id in permit_ids:
        asks.ask(sem, permit_id, waiter_lease=5.0, back_in=0.0, done=answers.append)


def test_many_asks_in_flight_are_answered_in_order(
    hub: Hub, redis_client: redis.Redis, prefix: str
) -> None:
    sem = FairSemaphore(redis_client, "pipelined", 3, prefix=prefix)
    asks = PipelinedAsks(hub, redis_client)
    answers: list[Answer] = []
    ask(asks, sem, answers, *(f"run-{i}" for i in range(10)))
    assert answers == []  # nothing waits for Redis: the answers come with the event loop
    run_until(hub, lambda: len(answers) == 10, 5)
    granted = [a for a in answers if isinstance(a, Permit)]
    assert [p.id for p in granted] == ["run-0", "run-1", "run-2"]
    waiting = answers[3:]
    assert all(isinstance(w, Waiting) for w in waiting)
    assert [w.position for w in waiting if isinstance(w, Waiting)] == list(range(1, 8))
    assert sorted(w.permit_id for w in sem.waiters()) == sorted(f"run-{i}" for i in range(3, 10))
    asks.close()


def test_a_lost_script_is_loaded_and_the_ask_answered(
    hub: Hub, redis_client: redis.Redis, prefix: str
) -> None:
    sem = FairSemaphore(redis_client, "noscript", 1, prefix=prefix)
    asks = PipelinedAsks(hub, redis_client)
    answers: list[Answer] = []
    ask(asks, sem, answers, "warm")
    run_until(hub, lambda: len(answers) == 1, 5)
    redis_client.script_flush()
    ask(asks, sem, answers, "after-flush", "and-another")
    run_until(hub, lambda: len(answers) == 3, 5)
    assert isinstance(answers[0], Permit)
    assert all(isinstance(a, Waiting) for a in answers[1:])
    asks.close()


def test_a_server_that_stops_answering_fails_the_asks_after_the_socket_timeout(
    hub: Hub,
) -> None:
    with embedded_valkey() as url:
        client = redis.Redis.from_url(url, socket_timeout=0.5)
        other = redis.Redis.from_url(url)
        sem = FairSemaphore(client, "paused", 1)
        asks = PipelinedAsks(hub, client)
        answers: list[Answer] = []
        other.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        started = time.monotonic()
        ask(asks, sem, answers, "a", "b")
        run_until(hub, lambda: len(answers) == 2, 5)
        assert time.monotonic() - started < 2.5  # the deadline, not the pause, ended them
        assert all(isinstance(a, BackendError) for a in answers)
        assert {a.permit_id for a in answers if isinstance(a, BackendError)} == {"a", "b"}
        other.execute_command("CLIENT", "UNPAUSE")
        # The next ask opens a new connection and is answered.
        ask(asks, sem, answers, "c")
        run_until(hub, lambda: len(answers) == 3, 5)
        assert isinstance(answers[2], Permit | Waiting)
        asks.close()
        client.close()
        other.close()


def test_a_connection_the_server_closes_fails_its_asks_and_the_next_one_reconnects(
    hub: Hub, redis_client: redis.Redis, prefix: str
) -> None:
    sem = FairSemaphore(redis_client, "killed", 1, prefix=prefix)
    asks = PipelinedAsks(hub, redis_client)
    answers: list[Answer] = []
    ask(asks, sem, answers, "first")
    run_until(hub, lambda: len(answers) == 1, 5)
    # Kill the asks' connection (the one client named by its socket's local address).
    connection = asks._connection
    host, port = connection._sock.getsockname()[:2]
    redis_client.client_kill(f"{host}:{port}")
    run_until(hub, lambda: asks._connection is None, 5)  # noticed as the socket reads EOF
    ask(asks, sem, answers, "second")
    run_until(hub, lambda: len(answers) == 2, 5)
    assert isinstance(answers[1], Waiting)  # "first" still holds the lock
    asks.close()


def test_clients_it_does_not_suit_get_asks_that_wait(
    hub: Hub, redis_client: redis.Redis, prefix: str
) -> None:
    class Mine(redis.Redis):
        pass

    assert isinstance(asks_for(hub, redis_client), PipelinedAsks)
    assert isinstance(asks_for(None, redis_client), WaitingAsks)
    own = Mine(connection_pool=redis_client.connection_pool)
    waiting = asks_for(hub, own)
    assert isinstance(waiting, WaitingAsks)
    answers: list[Answer] = []
    sem = FairSemaphore(own, "waiting", 1, prefix=prefix)
    ask(waiting, sem, answers, "x")
    assert len(answers) == 1  # answered before ask() returned
    assert isinstance(answers[0], Permit)


class SlowLink:
    """A TCP proxy to ``upstream`` that delays every reply by ``delay`` seconds (a far server)."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self.upstream, self.delay = upstream, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            self._sockets += [down, up]
            threading.Thread(target=self._pump, args=(down, up, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, self.delay), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, delay: float) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if delay:
                    time.sleep(delay)  # (the link's latency, not a test waiting)
                sink.sendall(data)


def test_a_lost_script_on_a_slow_link_is_not_taken_for_a_server_that_does_not_answer(
    hub: Hub, prefix: str
) -> None:
    # 0.4 s a reply, a 1 s socket timeout: the ask, the script's load and the ask again take
    # 1.2 s together, but each call answers within the timeout (the first ask after a start
    # tripped admission's timeout, and admission then paused for 5 s).
    with embedded_valkey() as url:
        server = redis.Redis.from_url(url)
        link = SlowLink(("127.0.0.1", server.connection_pool.connection_kwargs["port"]), 0.4)
        client = redis.Redis(host="127.0.0.1", port=link.port, socket_timeout=1.0)
        try:
            sem = FairSemaphore(client, "far", 1, prefix=prefix)
            server.script_flush()
            asks = PipelinedAsks(hub, client)
            answers: list[Answer] = []
            ask(asks, sem, answers, "run-0")
            run_until(hub, lambda: bool(answers), 10)
            assert isinstance(answers[0], Permit), answers
        finally:
            client.close()
            link.close()
            server.close()
