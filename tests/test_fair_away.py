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


def told(pubsub: redis.client.PubSub, seconds: float = 2.0) -> list[str]:
    """The permit ids published on the subscribed channel within ``seconds`` (all that came
    once the first did)."""
    got: list[str] = []
    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=seconds)
    while message is not None:
        got.append(message["data"].decode())
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
    return got


def test_an_away_waiter_with_a_channel_is_offered_the_permit_its_turn_frees(
    redis_client, redis_url, prefix
):
    sem = grouped(redis_client, prefix)
    channel = f"{prefix}:told"
    pubsub = redis.Redis.from_url(redis_url).pubsub()
    pubsub.subscribe(channel)
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    holder = ask(sem, "h", "a")
    assert isinstance(holder, Permit)
    parked = sem.attempt(
        "b-0", join_line=True, group="b", waiter_lease=60, back_in=30, notify=channel
    )
    assert isinstance(parked, Waiting)
    assert isinstance(away(sem, "b-1", "b"), Waiting)  # away without a channel: never told
    assert told(pubsub, 0.2) == []
    assert sem.release(holder)
    assert told(pubsub) == ["b-0"], "b's head is told its turn came"
    # Its place now holds the permit for it: an ask of the group that just released waits
    # (without the offer, a's present ask would take the permit b's away head cannot use).
    assert isinstance(ask(sem, "a-1", "a"), Waiting)
    lease_end = redis_client.zscore(f"{prefix}:{{away}}:fwx:b", "b-0")
    assert lease_end is not None
    assert lease_end - server_ms(redis_client) <= 2_000, (
        "an offer not taken ends within 2 s, so a waiter that never comes holds nothing long"
    )
    assert isinstance(ask(sem, "b-0", "b"), Permit)
    assert redis_client.hget(f"{prefix}:{{away}}:fwn:b", "b-0") is None
    pubsub.close()


def test_an_offer_goes_in_fair_order_and_permits_left_go_round_the_groups(
    redis_client, redis_url, prefix
):
    sem = grouped(redis_client, prefix, limit=3)
    channel = f"{prefix}:told"
    pubsub = redis.Redis.from_url(redis_url).pubsub()
    pubsub.subscribe(channel)
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    holders = [ask(sem, f"h{i}", "h") for i in range(3)]
    assert all(isinstance(p, Permit) for p in holders)
    for pid, group in [("a-0", "a"), ("a-1", "a"), ("a-2", "a"), ("b-0", "b")]:
        reply = sem.attempt(
            pid, join_line=True, group=group, waiter_lease=60, back_in=30, notify=channel
        )
        assert isinstance(reply, Waiting)
    assert sem.release(holders[0])
    assert told(pubsub) == ["a-0"], "one permit: the head of the group first in line"
    for permit in holders[1:]:
        assert sem.release(permit)
    # Two more free: b's head, then a's next (a second round over the groups). a-0, offered
    # already, is present now: a release pushes to its wake-up list instead.
    assert sorted(told(pubsub)) == ["a-1", "b-0"]
    assert redis_client.llen(f"{prefix}:{{away}}:wake:a-0") == 1
    assert isinstance(ask(sem, "a-2", "a"), Waiting), "every free permit is held for an offer"
    assert [
        isinstance(ask(sem, pid, "a" if pid != "b-0" else "b"), Permit)
        for pid in ("a-0", "a-1", "b-0")
    ] == [True, True, True]
    pubsub.close()


def test_notify_needs_a_grouped_semaphore_and_a_channel_name(redis_client, prefix):
    plain = FairSemaphore(redis_client, "plain", 1, prefix=prefix)
    with pytest.raises(ConfigurationError, match="needs a grouped semaphore"):
        plain.attempt("x", join_line=True, notify="ch")
    with pytest.raises(ConfigurationError, match="1 to 512 characters"):
        grouped(redis_client, prefix).attempt("x", join_line=True, group="a", notify="")


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000
