"""Redis unreachable while a task asks for its permit: a retry through Celery, never a drop.

The semaphores live on their own server, which is not running when the tasks arrive (nothing
listens on its port), then starts; broker and results stay on the test server throughout.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import task_retry

from celery_redsem import BackendError, FairSemaphore
from tests.integration.apps.tasks import make_app
from tests.integration.conftest import close_app, running_workers
from tests.servers import ServerProcess, wait_until


@pytest.fixture
def down_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server for the semaphores on a port where nothing listens until the test starts it."""
    server = ServerProcess([], tmp_path)
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def outage_app(redis_url: str, module_prefix: str, down_server: ServerProcess) -> Iterator[Celery]:
    """The test app, broker on the test server, semaphores on ``down_server``.

    Its own key prefix (so its queue is its own), under the module's (so it is cleaned up).
    """
    app = make_app(
        redis_url,
        f"{module_prefix}:outage",
        redsem_redis_url=down_server.url,
        redsem_retry_backoff=0.02,
        redsem_retry_backoff_max=0.1,
    )
    yield app
    close_app(app)


@pytest.fixture
def retries() -> Iterator[Counter[str]]:
    """Retries seen (``task_retry``), per task id."""
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def on_retry(request: object = None, **_: object) -> None:
        with lock:
            seen[str(getattr(request, "id", ""))] += 1

    task_retry.connect(on_retry, weak=False)
    yield seen
    task_retry.disconnect(on_retry)


def test_redis_down_at_acquire_retries_until_it_is_back(
    outage_app: Celery,
    down_server: ServerProcess,
    retries: Counter[str],
    key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="celery_redsem")
    with start_worker(
        outage_app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=30
    ):
        # Spends its wait budget (max_wait=0.5 s) on retries, then fails saying why.
        budget = outage_app.tasks["t.budget"].delay(key)
        with pytest.raises(BackendError, match=r"Redis failed.*max_wait=0\.5s") as info:
            budget.get(timeout=15)
        assert "Connection refused" in str(info.value)
        assert retries[budget.id] >= 2

        locked = outage_app.tasks["t.locked"].delay(key)  # max_retries=0
        wait_until(lambda: retries[locked.id] >= 3, 15, what="3 retries while Redis is down")
        assert locked.state in {"RETRY", "STARTED"}  # between tries, or in one: not failed
        down_server.start()
        out = locked.get(timeout=15)
    assert out["name"] == f"locked:{key}"
    # One warning while it is down, not one a retry (the others at INFO).
    levels = [r.levelno for r in caplog.records if "could not reach Redis" in r.getMessage()]
    caplog.clear()  # (its records hold Redis' errors, and those their sockets)
    assert len(levels) >= 5
    assert levels.count(logging.WARNING) == 1
    assert out["retries"] == 0  # max_retries=0 was not used up ...
    assert out["redis_errors"] >= 3  # ... by the retries after Redis errors
    assert out["contention_retries"] == 0


def test_a_cluster_unreachable_at_first_use_is_retried_not_failed(
    redis_url: str,
    module_prefix: str,
    down_server: ServerProcess,
    retries: Counter[str],
    key: str,
) -> None:
    # Building a cluster client already asks the cluster for its layout.
    app = make_app(
        redis_url,
        f"{module_prefix}:cluster-down",
        redsem_redis_url=down_server.url.replace("redis://", "redis+cluster://"),
        redsem_retry_backoff=0.02,
        redsem_retry_backoff_max=0.1,
    )
    try:
        with start_worker(
            app, pool="threads", concurrency=1, perform_ping_check=False, shutdown_timeout=30
        ):
            budget = app.tasks["t.budget"].delay(key)  # max_wait=0.5 s
            with pytest.raises(BackendError, match=r"gave up .*max_wait=0\.5s"):
                budget.get(timeout=15)
            assert retries[budget.id] >= 2
    finally:
        close_app(app)


def test_a_refusal_no_retry_can_fix_fails_the_task_at_once(
    redis_url: str, module_prefix: str, tmp_path: Path, retries: Counter[str], key: str
) -> None:
    # A wrong password is no outage: retrying for max_wait (an hour by default) would only
    # hide it. The task fails at once, saying why.
    server = ServerProcess(["--requirepass", "right"], tmp_path, ping_kwargs={"password": "right"})
    server.start()
    app = make_app(
        redis_url,
        f"{module_prefix}:refused",
        redsem_redis_url=server.url.replace("redis://", "redis://:wrong@"),
    )
    try:
        with start_worker(
            app, pool="threads", concurrency=1, perform_ping_check=False, shutdown_timeout=30
        ):
            result = app.tasks["t.locked"].delay(key)
            with pytest.raises(BackendError, match=r"no retry can fix \(AuthenticationError\)"):
                result.get(timeout=15)
            assert retries[result.id] == 0
            assert result.state == "FAILURE"
    finally:
        close_app(app)
        server.kill()


def test_a_release_that_cannot_reach_redis_is_logged_and_the_outcome_stands(
    outage_app: Celery,
    down_server: ServerProcess,
    key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Redis goes away while the body runs: the release fails, the task still succeeds, and
    # the permit frees itself when its lease ends (here: with the server's data).
    down_server.start()
    sem = FairSemaphore(
        down_server.client(), f"fifo:{key}", 1, prefix=outage_app.conf.redsem_key_prefix
    )
    with start_worker(
        outage_app, pool="threads", concurrency=1, perform_ping_check=False, shutdown_timeout=30
    ):
        result = outage_app.tasks["t.fifo"].delay(key, "body", -1)  # holds until told
        wait_until(lambda: [h.permit_id for h in sem.holders()] == [result.id], 15, what="held")
        down_server.kill()
        # (The level is set before the body may end: start_worker logs at ERROR only.)
        with caplog.at_level(logging.WARNING, logger="celery_redsem"):
            redis.Redis.from_url(outage_app.conf.broker_url).rpush(
                f"{outage_app.conf.redsem_key_prefix}:t:go:{key}", 1
            )
            assert result.get(timeout=20)["tag"] == "body"
            assert result.state == "SUCCESS"
            wait_until(
                lambda: f"could not release '{result.id}'" in caplog.text, 10, what="the warning"
            )


def test_an_eager_call_fails_at_once_with_backend_error_when_redis_is_down(
    redis_url: str, module_prefix: str, down_server: ServerProcess, key: str
) -> None:
    eager = make_app(
        redis_url,
        f"{module_prefix}:eager-down",
        redsem_redis_url=down_server.url,
        task_always_eager=True,
        redsem_eager_timeout=30,
    )
    try:
        started = time.monotonic()
        result = eager.tasks["t.locked"].delay(key)
        with pytest.raises(BackendError, match="Connection refused"):
            result.get()
        with pytest.raises(BackendError, match="Connection refused"):
            eager.tasks["t.locked"](key)  # a direct call
        assert time.monotonic() - started < 10  # at once, not after redsem_eager_timeout
    finally:
        close_app(eager)


@pytest.fixture
def hung_server_url() -> Iterator[str]:
    """A server that takes connections and never answers: hung, not refusing (the kernel
    completes the handshakes of connections nobody accepts, up to the backlog)."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


@pytest.mark.slow
def test_admission_pauses_longer_after_each_error_in_a_row(
    redis_url: str, module_prefix: str, tmp_path: Path, hung_server_url: str, key: str
) -> None:
    # Each try on a hung Redis blocks the worker's event loop for a socket timeout, holding
    # up every task: admission pauses 5 s after the first error, 10 s after the next ...
    prefix = f"{module_prefix}:hung"
    app = make_app(redis_url, prefix)  # sends the tasks: the workers' broker
    try:
        with running_workers(
            redis_url,
            prefix,
            tmp_path,
            ["hung"],
            2,
            redsem_redis_url=hung_server_url,
            redsem_redis_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
            redsem_check_eviction_policy=False,
        ) as (worker,):
            for n in range(4):  # retried after each error: they keep coming back
                app.tasks["t.locked"].delay(f"{key}-{n}")
            wait_until(
                lambda: "admission paused for 10s" in worker.log(), 20, what="a longer pause"
            )
            pauses = [line for line in worker.log().splitlines() if "admission paused" in line]
        assert len(pauses) == 2
        assert "paused for 5s after a Redis error" in pauses[0]
        assert "Timeout" in pauses[0]
    finally:
        close_app(app)
