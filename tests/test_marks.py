"""De-duplication marks (``dedupe.lua``) on a real server: one taker at a time, tied to a
permit while its run holds one, renewed without resurrecting, cleared only by their run."""

from __future__ import annotations

import multiprocessing
import uuid
from typing import Any

import redis

from celery_redsem import FairSemaphore
from celery_redsem.core.marks import DedupeMark
from tests.servers import wait_until


def _mark(client: redis.Redis, prefix: str, name: str = "job") -> DedupeMark:
    return DedupeMark(client, name, prefix=prefix)


def _fields(client: redis.Redis, prefix: str, name: str = "job") -> dict[str, str]:
    found = client.hgetall(f"{prefix}:{{{name}}}:dedupe")
    return {k.decode(): v.decode() for k, v in found.items()}


def test_the_first_taker_gets_it_and_later_ones_learn_who(redis_client, prefix):
    mark = _mark(redis_client, prefix)
    assert mark.take("a", 60) == "a"
    assert mark.take("b", 60) == "a"
    assert mark.claim("c", 60) == "a"
    assert mark.clear("b") is False  # not b's
    assert mark.take("a", 60) == "a"  # its own: still a's
    assert 0 < redis_client.pttl(f"{prefix}:{{job}}:dedupe") <= 60_000
    assert mark.clear("a") is True
    assert _fields(redis_client, prefix) == {}
    assert mark.take("b", 60) == "b"


def test_a_queued_mark_lives_its_ttl(redis_client, prefix):
    mark = _mark(redis_client, prefix)
    assert mark.take("a", 0.2) == "a"
    assert mark.take("b", 0.1) == "a"  # a shorter TTL does not shorten it
    wait_until(lambda: mark.take("b", 60) == "b", 5, what="a's mark to lapse")


def test_a_running_mark_lives_as_long_as_its_permit(redis_client, prefix):
    sem = FairSemaphore(redis_client, "job", 1, lease=0.3, prefix=prefix)
    permit = sem.acquire(permit_id="a")
    assert permit is not None
    mark = _mark(redis_client, prefix)
    mark.hold("a", permit.id, 60)
    assert mark.take("b", 60) == "a"
    # The permit's lease ends (its worker was lost): the mark no longer counts, long before
    # its own TTL.
    wait_until(lambda: mark.take("b", 60) == "b", 5, what="the permit to lapse")


def test_a_send_of_a_running_run_queues_it_again_but_its_claim_does_not(redis_client, prefix):
    mark = _mark(redis_client, prefix)
    mark.hold("a", "a", 60)
    assert mark.claim("a", 60) == "a"  # a copy of the run reaching a worker: left as it is
    assert _fields(redis_client, prefix) == {"id": "a", "run": "a"}
    assert mark.take("a", 60) == "a"  # the run's own retry: queued again
    assert _fields(redis_client, prefix) == {"id": "a"}


def test_keep_renews_only_the_runs_own_mark_and_never_brings_one_back(redis_client, prefix):
    key = f"{prefix}:{{job}}:dedupe"
    mark = _mark(redis_client, prefix)
    mark.hold("a", "permit-a", 0.5)
    assert mark.keep("a", "permit-a", 60) is True
    assert redis_client.pttl(key) > 1000
    assert mark.keep("a", "another-permit", 60) is False
    assert mark.keep("b", "permit-a", 60) is False
    assert mark.clear("a") is True
    assert mark.keep("a", "permit-a", 60) is False
    assert redis_client.exists(key) == 0


def _race(url: str, prefix: str, rounds: int, me: str, start: Any, out: Any) -> None:
    client = redis.Redis.from_url(url)
    seen = []
    for i in range(rounds):
        start.wait(30)
        seen.append(_mark(client, prefix, f"race-{i}").take(me, 60))
    out.put((me, seen))
    client.close()


def test_concurrent_takers_never_both_get_it(redis_url, prefix):
    rounds, takers = 40, 8
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Barrier(takers), ctx.Queue()
    names = [uuid.uuid4().hex[:8] for _ in range(takers)]
    procs = [
        ctx.Process(target=_race, args=(redis_url, prefix, rounds, me, start, out)) for me in names
    ]
    for proc in procs:
        proc.start()
    answers = dict(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    for i in range(rounds):
        holders = {answers[me][i] for me in names}
        winners = [me for me in names if answers[me][i] == me]
        assert len(holders) == 1, (i, holders)  # every taker was told the same run
        assert len(winners) == 1, (i, winners)
