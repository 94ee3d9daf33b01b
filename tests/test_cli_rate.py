"""``celery redsem status``, ``inspect``, ``pause`` and ``resume`` on rate limiters (against a
real server)."""

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


def test_status_shows_windows_units_left_and_pauses(
    app: Celery, redis_client: redis.Redis, prefix: str
) -> None:
    limiter = RateLimiter(redis_client, "llm:7", ["1/m", "100/d"], burst=[5, 100], prefix=prefix)
    assert limiter.attempt(cost=3)
    assert run(app, "pause", "llm:7", "120").output == "llm:7 is paused for 120.000s.\n"
    assert run(app, "pause", "idle:1", "60").exit_code == 0  # paused before its first start
    out = run(app, "status").output
    assert re.search(
        r"llm:7  rate limiter 0\.0166667/s  burst 5  \+ 0\.00115741/s burst 100  next free in "
        r"0\.000s  booked 0  units left 2/97  PAUSED 1[12]\d\.\ds",
        out,
    ), out
    assert re.search(
        r"idle:1  rate limiter \?  burst \?  .* units left \?  PAUSED [56]\d\.\ds", out
    )
    data = json.loads(run(app, "status", "--pattern", "llm:*", "--json").output)
    (state,) = data["rate_limiters"]
    assert 110 < state["paused"] <= 120
    assert [w["remaining"] for w in state["windows"]] == [2, 97]
    assert not limiter.attempt()
    inspected = run(app, "inspect", "llm:7").output
    assert f"key     {prefix}:{{llm:7}}:pause  (expires in 1" in inspected
    assert run(app, "resume", "llm:7").output == "llm:7 is not paused.\n"
    assert "PAUSED" not in run(app, "status", "llm:7").output
    assert limiter.attempt()


def test_pause_takes_a_number_of_seconds(app: Celery) -> None:
    for bad in ("0", "-1", "soon", "1e12"):
        result = run(app, "pause", "x", bad)
        assert result.exit_code == 2, (bad, result.output)
        assert "SECONDS" in result.output
    assert run(app, "pause", "a{b}", "1").exit_code == 1  # not a usable name: said so


def test_pause_and_resume_a_semaphore(app: Celery, redis_client: redis.Redis, prefix: str) -> None:
    sem = FairSemaphore(redis_client, "pdf:3", 2, prefix=prefix)
    held = sem.acquire(permit_id="held")
    assert held is not None
    assert run(app, "pause", "pdf:3", "90").output == "pdf:3 is paused for 90.000s.\n"
    assert sem.acquire() is None  # nothing granted meanwhile
    out = run(app, "status").output
    assert re.search(
        r"pdf:3  limit 2  held 1/2  waiting 0  last token \d+  PAUSED [89]\d\.\ds", out
    )
    assert re.search(r"PAUSED [89]\d\.\ds", run(app, "inspect", "pdf:3").output)
    assert run(app, "resume", "pdf:3").output == "pdf:3 is not paused.\n"
    assert "PAUSED" not in run(app, "status", "pdf:3").output
    assert sem.acquire() is not None
