"""An acquire whose reply never arrives: the error names the permit id, so the permit the
server granted can be released, and hold() (and an eager or direct call of a guarded task)
releases it itself (issue 20, item 8).

The lost reply is real: a small TCP proxy in front of the test server passes every request on
and, once told, swallows the replies on the connections open at that moment."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import suppress
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redsem import BackendError, FairSemaphore, Permit, with_lock
from celery_redsem.integration.settings import reset
from tests.servers import HOST, wait_until


class ReplyEater:
    """A TCP proxy to ``upstream``; :meth:`swallow_replies` black-holes the replies of the
    connections open now (connections made later work as usual)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self._open: list[dict[str, bool]] = []
        self._sockets: list[socket.socket] = [self.listener]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def swallow_replies(self) -> None:
        with self._lock:
            for connection in self._open:
                connection["swallow"] = True

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            state = {"swallow": False}
            with self._lock:
                self._open.append(state)
                self._sockets += [downstream, upstream]
            threading.Thread(
                target=self._pump, args=(downstream, upstream, None), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(upstream, downstream, state), daemon=True
            ).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, state: dict[str, bool] | None) -> None:
        try:
            while data := source.recv(65536):
                if state is None or not state["swallow"]:
                    sink.sendall(data)
        except OSError:
            return
        finally:
            for sock in (source, sink):
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxy(redis_url: str) -> Iterator[ReplyEater]:
    parsed = urlparse(redis_url)
    eater = ReplyEater((parsed.hostname or HOST, parsed.port or 6379))
    yield eater
    eater.close()


@pytest.fixture
def proxied(redis_url: str, proxy: ReplyEater) -> Iterator[redis.Redis]:
    """A client through the proxy (to the test server's database): a short socket timeout and
    no retries."""
    db = int(urlparse(redis_url).path.lstrip("/") or 0)
    client = redis.Redis(
        host=HOST, port=proxy.port, db=db, socket_timeout=0.3, retry=Retry(NoBackoff(), 0)
    )
    yield client
    client.close()


def _sem(client: redis.Redis, prefix: str) -> FairSemaphore:
    return FairSemaphore(client, "unanswered", 1, lease=30, prefix=prefix)


def _holder_ids(redis_client: redis.Redis, prefix: str) -> list[str]:
    return [h.permit_id for h in _sem(redis_client, prefix).state().holders]


def _warm_up(sem: FairSemaphore) -> None:
    """Open the connections the next calls will use (the proxy swallows only open ones) and
    load the scripts (a NOSCRIPT answer swallowed would leave nothing granted)."""
    for _ in range(3):
        permit = sem.acquire()
        assert isinstance(permit, Permit)
        assert sem.release(permit)


@pytest.mark.parametrize("blocking", [False, True])
def test_the_error_names_the_granted_permit_so_it_can_be_released(
    redis_client: redis.Redis, prefix: str, proxy: ReplyEater, proxied: redis.Redis, blocking: bool
) -> None:
    sem = _sem(proxied, prefix)
    _warm_up(sem)
    proxy.swallow_replies()
    with pytest.raises(BackendError) as info:
        sem.acquire(blocking=blocking, timeout=5 if blocking else None)
    permit_id = info.value.permit_id
    assert permit_id is not None
    # The server did grant it: the reply was what got lost.
    wait_until(lambda: _holder_ids(redis_client, prefix) == [permit_id], 5, what="the grant")
    assert sem.release(permit_id)  # over a new connection, which the proxy lets through
    assert _holder_ids(redis_client, prefix) == []


def test_attempt_names_the_permit_id_too(
    prefix: str, proxy: ReplyEater, proxied: redis.Redis
) -> None:
    sem = _sem(proxied, prefix)
    _warm_up(sem)
    proxy.swallow_replies()
    with pytest.raises(BackendError) as info:
        sem.attempt("given-id", join_line=True)
    assert info.value.permit_id == "given-id"


def test_hold_releases_a_grant_whose_reply_was_lost(
    redis_client: redis.Redis, prefix: str, proxy: ReplyEater, proxied: redis.Redis
) -> None:
    sem = _sem(proxied, prefix)
    _warm_up(sem)
    proxy.swallow_replies()
    with pytest.raises(BackendError) as info, sem.hold(timeout=5):
        pytest.fail("the block must not run")
    assert info.value.permit_id is not None
    assert _holder_ids(redis_client, prefix) == []  # not left held for a 30 s lease
    later = _sem(redis_client, prefix).acquire()
    assert isinstance(later, Permit)


def test_an_eager_task_releases_a_grant_whose_reply_was_lost(
    redis_client: redis.Redis, prefix: str, proxy: ReplyEater
) -> None:
    app = Celery("redsem-unanswered", broker="memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        redsem_redis_url=f"redis://{HOST}:{proxy.port}/0",
        redsem_redis_options={"socket_timeout": 0.3, "retry": Retry(NoBackoff(), 0)},
        redsem_key_prefix=prefix,
        redsem_lease=30,
    )

    @app.task(name="t.unanswered")
    @with_lock(key="unanswered")
    def guarded() -> str:
        return "ran"

    try:
        for _ in range(3):  # open the connections the next call uses, load the scripts
            assert guarded.delay().get(timeout=5) == "ran"
        proxy.swallow_replies()
        with pytest.raises(BackendError) as info:
            guarded.delay().get(timeout=10)
        assert info.value.permit_id is not None
        assert _holder_ids(redis_client, prefix) == []  # not left held for a 30 s lease
    finally:
        reset(app)
        app.close()
