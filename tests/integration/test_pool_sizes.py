"""Pool sizes that fit the pool: the plugin's Redis connection pool is widened to a worker's
concurrency where its tasks share one process, and a worker whose Redis broker pool is smaller
than that says so as it starts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_redsem import get_client
from celery_redsem.integration.settings import SPARE_CONNECTIONS, expect_concurrency
from celery_redsem.integration.worker.start_checks import (
    check_broker_pool,
    check_visibility_timeout,
)
from tests.integration.apps.tasks import make_app
from tests.integration.conftest import close_app


@pytest.fixture
def fresh_app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    application = make_app(redis_url, module_prefix)
    yield application
    close_app(application)


def test_the_client_pool_holds_a_connection_per_task_and_some_to_spare(fresh_app: Celery) -> None:
    expect_concurrency(fresh_app, 200)
    default = redis.ConnectionPool().max_connections  # 100 on redis-py 8, 2**31 before
    wanted = max(default, 200 + SPARE_CONNECTIONS)  # (a larger default pool is kept)
    assert get_client(fresh_app).connection_pool.max_connections == wanted


def test_a_pool_size_the_user_set_is_kept(redis_url: str, module_prefix: str) -> None:
    app = make_app(redis_url, module_prefix, redsem_redis_options={"max_connections": 50})
    try:
        expect_concurrency(app, 200)
        assert get_client(app).connection_pool.max_connections == 50
    finally:
        close_app(app)


def test_a_pool_larger_than_needed_is_not_narrowed(fresh_app: Celery) -> None:
    expect_concurrency(fresh_app, 4)
    assert get_client(fresh_app).connection_pool.max_connections >= 4 + SPARE_CONNECTIONS


@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_a_redis_broker_pool_smaller_than_the_concurrency_is_warned_about(
    fresh_app: Celery, pool: str
) -> None:
    warning = check_broker_pool(fresh_app, pool, 20) or ""
    assert "holds 10 (kombu's max_connections)" in warning
    assert "'max_connections': 30" in warning
    assert "CELERY_BROKER_TRANSPORT_OPTIONS" in warning


def test_no_broker_pool_warning_where_it_fits(fresh_app: Celery) -> None:
    assert check_broker_pool(fresh_app, "threads", 10) is None  # as many as it holds
    assert check_broker_pool(fresh_app, "prefork", 100) is None  # a process per task
    fresh_app.conf.broker_transport_options = {"max_connections": 200}
    assert check_broker_pool(fresh_app, "gevent", 100) is None
    fresh_app.conf.broker_url = "amqp://guest@127.0.0.1//"
    fresh_app.conf.broker_transport_options = {}
    assert check_broker_pool(fresh_app, "gevent", 100) is None  # not a Redis broker


def test_a_visibility_timeout_too_short_for_parking_is_warned_about(fresh_app: Celery) -> None:
    assert check_visibility_timeout(fresh_app) is None  # unset: Celery's hour
    fresh_app.conf.broker_transport_options = {"visibility_timeout": 10}
    warning = check_visibility_timeout(fresh_app) or ""
    assert "visibility_timeout is 10s" in warning
    assert "'visibility_timeout': 600" in warning
    fresh_app.conf.broker_transport_options = {"visibility_timeout": 3600}
    assert check_visibility_timeout(fresh_app) is None
