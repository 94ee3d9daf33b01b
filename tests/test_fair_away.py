"""Away waiters (``back_in``) of a grouped semaphore, on a real server: a place of a waiter that
is away keeps its group's place but holds no free permit for it; the next present waiter of the
group, or the next group with one present, is served meanwhile."""

from __future__ import annotations

import pytest
import redis

from celery_redsem import ConfigurationError, FairSemaphore, Permit, Waiting


def grouped(client: redis.Redis, prefix: str, limit: int = 1) -> FairSemaphore:
    return FairSemaphore(client, "away", limit, prefix=prefix, lease=30, grouped=True)


def away(sem: FairSemaphore, pid: str, group: str, seconds: float = 20.0) -> Permit | Waiting:
    return sem.attempt(pid, join_line=True, group=group, waiter_lease=seconds + 10, back_in=seconds)


def ask(sem: FairSemaphore, pid: str, group: str) -> Permit | Waiting:
    return sem.attempt(pid, join_line=True, group=group)


def test_a_present_waiter_is_served_while_the_head_of_its_group_is_away(redis_client, prefix):
    sem = grouped(redis_client, prefix)
    holder = ask(sem, "h", "a")
    assert isinstance(holder, Permit)
    assert isinstance(away(sem, "a-0", "a"), Waiting)
    assert isinstance(ask(sem, "a-1", "a"), Waiting)
    assert isinstance(ask(sem, "a-2", "a"), Waiting)
    assert sem.release(holder)
    assert isinstance(ask(sem, "a-2", "a"), Waiting), "FIFO among the present ones"
    got = ask(sem, "a-1", "a")
    assert isinstance(got, Permit), "the away head holds no free permit"
    assert sem.release(got)
    # Back, the away waiter comes before a-2 (present all along): it kept its place.
    assert isinstance(ask(sem, "a-0", "a"), Permit)
    assert isinstance(ask(sem, "a-2", "a"), Waiting)


def test_a_group_whose_waiters_are_all_away_is_passed_over(redis_client, prefix):
    sem = grouped(redis_client, prefix)
    holder = ask(sem, "h", "a")
    assert isinstance(holder, Permit)
    for i in range(3):
        assert isinstance(away(sem, f"a-{i}", "a"), Waiting)
    assert isinstance(ask(sem, "b-0", "b"), Waiting)
    assert sem.release(holder)
    assert isinstance(ask(sem, "b-0", "b"), Permit), "a's places hold no free permit"
    # a kept its turn: back, its first is served before b's next, present all along.
    assert isinstance(ask(sem, "b-1", "b"), Waiting)
    assert sem.release("b-0")
    assert isinstance(ask(sem, "a-0", "a"), Permit)
    assert isinstance(ask(sem, "b-1", "b"), Waiting)


def test_a_newcomer_is_served_at_once_when_its_group_waits_away(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=2)
    assert isinstance(ask(sem, "h", "a"), Permit)
    assert isinstance(ask(sem, "h2", "a"), Permit)
    assert isinstance(away(sem, "a-0", "a"), Waiting)
    assert sem.release("h")
    assert isinstance(ask(sem, "a-new", "a"), Permit)
    assert [(g.group, g.holders, g.waiting) for g in sem.groups()] == [("a", 2, 1)]


def test_a_release_wakes_the_present_head_not_the_away_one(redis_client, prefix):
    sem = grouped(redis_client, prefix)
    holder = ask(sem, "h", "a")
    assert isinstance(holder, Permit)
    assert isinstance(away(sem, "a-0", "a"), Waiting)
    assert isinstance(ask(sem, "b-0", "b"), Waiting)
    assert sem.release(holder)
    assert redis_client.llen(sem.keys.wake("b-0")) == 1
    assert redis_client.exists(sem.keys.wake("a-0")) == 0


def test_every_away_key_expires(redis_client, prefix):
    sem = grouped(redis_client, prefix)
    assert isinstance(ask(sem, "h", "a"), Permit)
    assert isinstance(away(sem, "a-0", "a"), Waiting)
    due = f"{prefix}:{{away}}:fwd:a"
    assert redis_client.zcard(due) == 1
    assert redis_client.pttl(due) > 0
    assert sem.release("a-0")  # its place given up
    assert redis_client.zcard(due) == 0


def test_a_view_in_a_group_asks_with_its_group_and_weight(redis_client, prefix):
    sem = grouped(redis_client, prefix)
    pro = sem.in_group("pro", 2)
    assert sem.group is None
    assert isinstance(pro.attempt("p-0", join_line=True), Permit)
    assert isinstance(pro.attempt("p-1", join_line=True), Waiting)
    assert [(g.group, g.holders, g.waiting, g.weight) for g in sem.groups()] == [("pro", 1, 1, 2.0)]
    for bad, message in (("", "needs a group"), ("a\0b", "NUL")):
        with pytest.raises(ConfigurationError, match=message):
            sem.in_group(bad)
    with pytest.raises(ConfigurationError, match="weight must be"):
        sem.in_group("g", 0)
    plain = FairSemaphore(redis_client, "plain", 1, prefix=prefix)
    with pytest.raises(ConfigurationError, match="not grouped"):
        plain.in_group("g")
