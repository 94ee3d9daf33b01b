"""Offers of a grouped semaphore (issue 40): a release wakes the task next in fair order,
wherever it is parked, through its worker's Pub/Sub channel
(:mod:`celery_redsem.integration.worker.fair_wakes`). The listener on a real server (offers
handed on, a killed subscription opened again), then fair shares through real workers on the
threads, gevent and eventlet pools (prefork: ``test_fair_workers.py``)."""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redsem.integration.worker.fair_wakes import FairWakes
from tests.integration.apps.fair_tasks import make_fair_app
from tests.integration.conftest import close_app, running_workers
from tests.integration.test_fair_workers import accounts_share_by_weight
from tests.servers import wait_until

APP_MODULE = "tests.integration.apps.fair_worker_app"


@pytest.fixture(scope="module")
def app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    application = make_fair_app(redis_url, module_prefix)
    yield application
    close_app(application)


def in_thread(fn: Callable[..., Any], *args: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


class Recorded(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def subscription_ids(client: redis.Redis, name: str) -> list[int]:
    return [int(c["id"]) for c in client.client_list() if c.get("name") == name]


def test_the_listener_hands_on_each_offer_and_subscribes_again_after_a_lost_connection(
    redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    got: queue.Queue[str] = queue.Queue()
    name = f"offers-{prefix}"
    wakes = FairWakes(redis.Redis.from_url(redis_url, client_name=name), prefix, got.put)
    assert wakes.channel is None
    wakes.start_green(in_thread, lambda fn, *args: fn(*args))
    try:
        wait_until(lambda: wakes.channel is not None, 5, what="the subscription")
        channel = wakes.channel
        assert channel is not None
        assert channel.startswith(f"{prefix}:offers:")
        assert redis_client.publish(channel, "run-1") == 1
        assert got.get(timeout=5) == "run-1"
        (first,) = subscription_ids(redis_client, name)
        warnings = Recorded()
        logger = logging.getLogger("celery_redsem.integration.worker.fair_wakes")
        # (An earlier test's worker may have set the root logger to ERROR, with handlers of
        # its own.)
        logger.addHandler(warnings)
        level = logger.level
        logger.setLevel(logging.WARNING)
        try:
            redis_client.client_kill_filter(_id=str(first))
            wait_until(
                lambda: subscription_ids(redis_client, name) not in ([], [first]),
                10,
                what="a new subscription after the old one was killed",
            )
        finally:
            logger.removeHandler(warnings)
            logger.setLevel(level)
        assert any("the channel for fair-share offers was lost" in m for m in warnings.messages)
        wait_until(lambda: redis_client.publish(channel, "run-2") == 1, 5, what="a listener")
        assert got.get(timeout=5) == "run-2"
    finally:
        wakes.close()
    wait_until(lambda: not subscription_ids(redis_client, name), 5, what="the listener to stop")


def test_a_listener_that_cannot_subscribe_tries_less_often_and_warns_once(
    redis_url: str, prefix: str
) -> None:
    # Nothing listens on the port: each try fails at once. (On the event loop a try waits for
    # the connection, so an outage must not make it try every second; nor log every try.)
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    closed_url = f"redis://127.0.0.1:{port.getsockname()[1]}/0"
    port.close()
    got: queue.Queue[str] = queue.Queue()
    wakes = FairWakes(redis.Redis.from_url(closed_url), prefix, got.put)
    warnings = Recorded()
    logger = logging.getLogger("celery_redsem.integration.worker.fair_wakes")
    logger.addHandler(warnings)
    level = logger.level
    logger.setLevel(logging.WARNING)
    delays = []
    try:
        for _ in range(7):
            with pytest.raises(redis.ConnectionError):
                wakes._subscribed()
            delays.append(wakes._lost(redis.ConnectionError("refused")))
    finally:
        logger.removeHandler(warnings)
        logger.setLevel(level)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert len(warnings.messages) == 1
    assert "next try in 1s" in warnings.messages[0]
    assert wakes.channel is None  # asks give no channel meanwhile


@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_accounts_share_by_weight_on_the_threads_gevent_and_eventlet_pools(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str, pool: str
) -> None:
    # As test_fair_workers' prefork test, on one worker of the pool.
    with running_workers(
        redis_url, module_prefix, tmp_path, [pool], 8, pool=pool, app_module=APP_MODULE
    ):
        accounts_share_by_weight(app, key)
