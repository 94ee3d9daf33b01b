"""The worker-start check of Redis' eviction policy, against real servers."""

from __future__ import annotations

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from celery_redsem.integration.worker.start_checks import check_eviction_policy
from tests.integration.apps.tasks import make_app
from tests.integration.conftest import close_app
from tests.servers import embedded_valkey


@pytest.mark.parametrize(
    ("policy", "warns"), [("noeviction", False), ("allkeys-lru", True), ("volatile-ttl", True)]
)
def test_warns_when_keys_could_be_evicted(policy: str, warns: bool) -> None:
    with embedded_valkey(**{"maxmemory-policy": policy}) as url:
        client = redis.Redis.from_url(url)
        warning = check_eviction_policy(client)
        client.close()
    assert (warning is not None) == warns
    if warns:
        assert warning is not None
        assert policy in warning


def test_a_server_without_config_is_still_checked() -> None:
    # CONFIG is often disabled for application users; the policy is read from INFO memory.
    with embedded_valkey(
        **{"rename-command": 'CONFIG ""', "maxmemory-policy": "allkeys-lru"}
    ) as url:
        client = redis.Redis.from_url(url)
        assert "allkeys-lru" in (check_eviction_policy(client) or "")
        client.close()


def test_a_server_that_does_not_answer_is_reported_not_fatal() -> None:
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=None)
    warning = check_eviction_policy(client) or ""
    assert "cannot reach the semaphores' Redis at worker start" in warning
    assert "Connection refused" in warning


@pytest.mark.parametrize("check", [True, False])
def test_a_worker_warns_at_start_unless_told_not_to(
    check: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with embedded_valkey(**{"maxmemory-policy": "allkeys-lru"}) as url:
        app = make_app(url, "evict", redsem_check_eviction_policy=check)
        caplog.set_level("WARNING", logger="celery_redsem.integration.worker.start_checks")
        try:
            with start_worker(app, pool="solo", perform_ping_check=False):
                pass
        finally:
            close_app(app)
    warned = any("maxmemory-policy is 'allkeys-lru'" in r.getMessage() for r in caplog.records)
    assert warned is check
