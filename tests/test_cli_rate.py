"""``celery redsem status`` and ``inspect`` show rate limiters (against a real server)."""

from __future__ import annotations

import json
import re

import redis
from celery import Celery

from celery_redsem import FairSemaphore, RateLimiter
from tests.test_cli import app, run

__all__ = ["app"]  # the fixture, shared with tests/test_cli.py


def _limiters(redis_client: redis.Redis, prefix: str) -> RateLimiter:
    """``api:42`` at 0.2/s with two slots booked ahead (slow limiters: nothing expires or passes
    while a slow host runs a test); ``market:alice`` a semaphore and a
    limiter of the same name; nothing else."""
    api = RateLimiter(redis_client, "api:42", "12/m", burst=1, prefix=prefix)
    assert api.attempt("run-1")
    for n in (2, 3):
        assert api.attempt(f"run-{n}", book=True).booked
    market = RateLimiter(redis_client, "market:alice", "12/m", burst=3, prefix=prefix)
    assert market.attempt("buy-1")
    assert FairSemaphore(redis_client, "market:alice", 2, prefix=prefix).acquire(permit_id="b")
    return api


def test_status_lists_rate_limiters(app: Celery, redis_client: redis.Redis, prefix: str) -> None:
    _limiters(redis_client, prefix)
    out = run(app, "status").output
    assert re.search(
        r"api:42  rate limiter 0\.2/s  burst 1  next free in 1[45]\.\d\d\ds  booked 2", out
    )
    assert "market:alice  rate limiter 0.2/s  burst 3" in out
    assert "market:alice  limit 2  held 1/2" in out
    data = json.loads(run(app, "status", "--pattern", "api:*", "--json").output)
    assert data["semaphores"] == []
    (limiter,) = data["rate_limiters"]
    assert (limiter["name"], limiter["rate"], limiter["burst"], limiter["booked"]) == (
        "api:42",
        0.2,
        1,
        2,
    )
    assert 14.0 < limiter["next_free"] <= 15.0


def test_inspect_shows_a_rate_limiter(app: Celery, redis_client: redis.Redis, prefix: str) -> None:
    _limiters(redis_client, prefix)
    result = run(app, "inspect", "api:42")  # a rate limiter only: found
    assert result.exit_code == 0, result.output
    assert "api:42  rate limiter 0.2/s  burst 1" in result.output
    assert f"key     {prefix}:{{api:42}}:rate  (expires in" in result.output
    assert "remembered ids 3" in result.output
    data = json.loads(run(app, "inspect", "api:42", "--json").output)
    assert data["exists"] is True
    assert data["limit"] is None
    assert data["rate_limiter"]["booked"] == 2
    assert all(ttl > 0 for ttl in data["key_ttls_ms"].values())
    both = run(app, "inspect", "market:alice").output
    assert "market:alice  limit 2  held 1/2" in both
    assert "market:alice  rate limiter 0.2/s  burst 3" in both
    missing = run(app, "inspect", "api:43", "--json")
    assert missing.exit_code == 1
    assert json.loads(missing.stdout)["rate_limiter"] is None
