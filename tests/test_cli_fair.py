"""``celery redsem`` on a grouped semaphore: status and inspect show its groups, release takes
a grouped permit or place away keeping the groups' books, purge deletes every fair key."""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery

from celery_redsem import FairSemaphore, Permit, Waiting
from tests.test_cli import app, run

__all__ = ["app"]  # (the fixture, used by name)


@pytest.fixture
def fair(redis_client: redis.Redis, prefix: str) -> FairSemaphore:
    """``market-api`` (limit 2, grouped): acme holds 2 and has 1 waiting, beta (weight 2) 1."""
    sem = FairSemaphore(redis_client, "market-api", 2, prefix=prefix, lease=30, grouped=True)
    acme, beta = sem.in_group("acme"), sem.in_group("beta", 2)
    assert isinstance(acme.attempt("a-1", join_line=True), Permit)
    assert isinstance(acme.attempt("a-2", join_line=True), Permit)
    assert isinstance(acme.attempt("a-3", join_line=True), Waiting)
    assert isinstance(beta.attempt("b-1", join_line=True), Waiting)
    return sem


def test_status_and_inspect_show_the_groups(app: Celery, fair: FairSemaphore) -> None:
    text = run(app, "status", "market-api")
    assert text.exit_code == 0, text.output
    lines = [line.split() for line in text.output.splitlines() if "group" in line]
    # beta first: it has been served less (0 grants against 2)
    assert [line[:10] for line in lines] == [
        ["group", "beta", "holders", "0", "waiting", "1", "weight", "2", "served", "0"],
        ["group", "acme", "holders", "2", "waiting", "1", "weight", "1", "served", "2"],
    ]
    assert text.output.count("holder  ") == 2
    shown = json.loads(run(app, "status", "--json").output)
    (state,) = shown["semaphores"]
    assert [(g["group"], g["holders"], g["waiting"]) for g in state["groups"]] == [
        ("beta", 0, 1),
        ("acme", 2, 1),
    ]
    inspected = run(app, "inspect", "market-api")
    assert "groups (2, waiting ones in the order they are served)" in inspected.output
    assert "group   acme  holders 2  waiting 1  weight 1  served 2  share 2" in inspected.output
    as_json = json.loads(run(app, "inspect", "market-api", "--json").output)
    assert [g["share"] for g in as_json["groups"]] == [0.0, 2.0]
    assert any(key.endswith(":fair") for key in as_json["key_ttls_ms"])
    assert all(ttl > 0 for ttl in as_json["key_ttls_ms"].values())


def test_release_keeps_the_books_of_a_grouped_semaphore(app: Celery, fair: FairSemaphore) -> None:
    assert run(app, "release", "market-api", "b-1").output.startswith("Removed b-1")
    assert "Released the permit of a-1" in run(app, "release", "market-api", "a-1").output
    assert [(g.group, g.holders, g.waiting) for g in fair.groups()] == [("acme", 1, 1)]
    assert isinstance(fair.in_group("acme").attempt("a-3", join_line=True), Permit)


def test_purge_deletes_every_fair_key(
    app: Celery, fair: FairSemaphore, redis_client: redis.Redis, prefix: str
) -> None:
    fair.in_group("late").attempt("l-1", join_line=True, waiter_lease=20, back_in=5)
    before = {k.decode() for k in redis_client.scan_iter(match=f"{prefix}:*")}
    assert {f"{prefix}:{{market-api}}:{kind}late" for kind in ("fw:", "fwx:", "fwd:")} <= before
    done = run(app, "purge", "market-api", "--yes", "--json")
    assert json.loads(done.output)["purged"] == 1
    assert list(redis_client.scan_iter(match=f"{prefix}:*")) == []
