"""Fair share by group in the core semaphore, on a real server: weighted shares, FIFO within a
group, late groups, group limits, leases, idempotence, fencing, TTLs and the hash slot."""

from __future__ import annotations

import threading
from collections import Counter, deque

import pytest
import redis
from redis.crc import key_slot

from celery_redsem import ConfigurationError, FairSemaphore, Permit, Waiting
from celery_redsem.core.keys import SemaphoreKeys
from tests.servers import wait_until


def grouped(client: redis.Redis, prefix: str, limit: int = 4, **options: object) -> FairSemaphore:
    options.setdefault("lease", 30)
    return FairSemaphore(client, "fair", limit, prefix=prefix, grouped=True, **options)  # type: ignore[arg-type]


def join(sem: FairSemaphore, pid: str, group: str, weight: float = 1.0) -> Permit | Waiting:
    return sem.attempt(pid, join_line=True, group=group, weight=weight)


def serve(
    sem: FairSemaphore, lines: dict[str, deque[str]], held: deque[Permit], weights: dict[str, float]
) -> str:
    """Free the oldest permit, then let every waiter of every group try (heads last, so a
    grant cannot come from trying order): exactly one must be granted; its group."""
    assert sem.release(held.popleft())
    granted = []
    for group in sorted(lines, reverse=True):
        for pid in reversed(lines[group]):
            result = join(sem, pid, group, weights[group])
            if isinstance(result, Permit):
                granted.append((group, pid, result))
    assert len(granted) == 1, granted
    group, pid, permit = granted[0]
    assert lines[group][0] == pid, "FIFO within a group: only its head is granted"
    lines[group].popleft()
    held.append(permit)
    return group


def fill(
    sem: FairSemaphore, counts: dict[str, int], weights: dict[str, float]
) -> tuple[deque[Permit], dict[str, deque[str]]]:
    """Every group's callers join in turn, group after group (the first group's backlog first)."""
    held: deque[Permit] = deque()
    lines: dict[str, deque[str]] = {g: deque() for g in counts}
    for group, n in counts.items():
        for i in range(n):
            pid = f"{group}-{i}"
            result = join(sem, pid, group, weights[group])
            if isinstance(result, Permit):
                held.append(result)
            else:
                lines[group].append(pid)
    return held, lines


@pytest.mark.parametrize("weights", [(1, 1, 1), (2, 1, 1)])
def test_with_all_groups_waiting_grants_follow_the_weighted_shares(redis_client, prefix, weights):
    sem = grouped(redis_client, prefix, limit=4)
    w = dict(zip("abc", map(float, weights), strict=True))
    held, lines = fill(sem, {"a": 60, "b": 60, "c": 60}, w)
    assert [p.id for p in held] == ["a-0", "a-1", "a-2", "a-3"]  # first come, while nobody waits
    starts = []
    while all(lines.values()):
        starts.append(serve(sem, lines, held, w))
    counts = Counter(starts)
    for group, weight in w.items():
        share = counts[group] / len(starts)
        assert abs(share - weight / sum(w.values())) <= 0.05, (counts, len(starts))
    assert len(starts) >= 100


def test_a_late_group_is_served_at_once_not_after_the_backlog(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=2)
    w = {"a": 1.0, "b": 1.0, "late": 1.0}
    held, lines = fill(sem, {"a": 30, "b": 30}, w)
    for _ in range(10):
        serve(sem, lines, held, w)
    assert isinstance(join(sem, "late-0", "late"), Waiting)
    lines["late"] = deque(["late-0"])
    # Within the round under way (before a or b is served twice), not after 40 waiters.
    assert "late" in [serve(sem, lines, held, w) for _ in range(2)]


def test_an_idle_group_banks_no_credit(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=1)
    w = {"a": 1.0, "b": 1.0}
    held, lines = fill(sem, {"a": 20, "b": 1}, w)
    assert serve(sem, lines, held, w) == "b"  # b's only waiter, then b is idle
    starts = [serve(sem, lines, held, w) for _ in range(10)]
    assert starts == ["a"] * 10
    for i in range(1, 6):  # b comes back with 5: it alternates with a, not 10 in a row
        lines["b"].append(f"b-{i}")
        assert isinstance(join(sem, f"b-{i}", "b"), Waiting)
    starts = [serve(sem, lines, held, w) for _ in range(6)]
    assert starts in (["b", "a"] * 3, ["a", "b"] * 3)


def test_group_limit_caps_what_one_group_holds_and_others_get_the_rest(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=4, group_limit=2)
    permits = [join(sem, f"a-{i}", "a") for i in range(5)]
    assert [isinstance(p, Permit) for p in permits] == [True, True, False, False, False]
    b = [join(sem, f"b-{i}", "b") for i in range(3)]
    assert [isinstance(p, Permit) for p in b] == [True, True, False]
    c = join(sem, "c-0", "c")
    assert isinstance(c, Waiting)
    assert c.position == 1
    by_group = {g.group: g for g in sem.groups()}
    assert (by_group["a"].holders, by_group["a"].waiting, by_group["a"].at_limit) == (2, 3, True)
    assert sem.release(permits[0])  # type: ignore[arg-type]
    assert isinstance(join(sem, "a-2", "a"), Permit)  # a's own permit back, to a's head
    assert isinstance(join(sem, "a-3", "a"), Waiting)


def test_group_limit_is_never_exceeded_under_threads(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=5, group_limit=2, lease=5, waiter_lease=2)
    lock = threading.Lock()
    now: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    total_peak = [0]
    errors: list[BaseException] = []

    def worker(group: str, i: int) -> None:
        try:
            for round_ in range(4):
                with sem.hold(timeout=30, permit_id=f"{group}-{i}-{round_}", group=group):
                    with lock:
                        now[group] += 1
                        peak[group] = max(peak[group], now[group])
                        total_peak[0] = max(total_peak[0], sum(now.values()))
                    threading.Event().wait(0.005)
                    with lock:
                        now[group] -= 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(g, i)) for g in "abc" for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert max(peak.values()) <= 2
    assert total_peak[0] <= 5
    assert peak["a"] == 2  # the cap was reached, not merely never approached


def test_an_expired_holder_frees_its_permit_for_the_next_group_within_a_lease(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=1, lease=0.5, waiter_lease=5)
    crashed = sem.acquire(group="a")  # never released, never refreshed
    assert crashed is not None
    permit = sem.acquire(blocking=True, timeout=5, group="b")
    assert permit is not None
    assert permit.token > crashed.token
    server_ms = int(redis_client.time()[0]) * 1000
    assert server_ms >= crashed.expires_at - 1000  # (server clock, whole seconds)


def test_attempts_are_idempotent_per_permit_id(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=1)
    first = join(sem, "x", "a")
    again = join(sem, "x", "a")
    assert isinstance(first, Permit)
    assert isinstance(again, Permit)
    assert again.token == first.token
    waiting = join(sem, "y", "b")
    assert isinstance(waiting, Waiting)
    assert waiting.position == 1
    assert join(sem, "y", "b").position == 1  # type: ignore[union-attr]
    assert [g.waiting for g in sem.groups() if g.group == "b"] == [1]
    assert sem.release(first)
    assert not sem.release(first)
    granted = join(sem, "y", "b")
    assert isinstance(granted, Permit)
    assert granted.token > first.token


def test_a_waiter_that_gives_up_leaves_its_group(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=1)
    held = join(sem, "x", "a")
    assert isinstance(join(sem, "y", "b"), Waiting)
    assert sem.acquire(blocking=True, timeout=0.05, permit_id="z", group="c") is None
    assert [g.group for g in sem.groups() if g.waiting] == ["b"]
    assert sem.release("y") is True  # leaves the line
    assert sem.groups() == [g for g in sem.groups() if g.group == "a"]
    assert sem.release(held)  # type: ignore[arg-type]


def test_fencing_tokens_increase_across_groups(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=2)
    tokens = []
    for i in range(20):
        permit = sem.acquire(group="ab"[i % 2], weight=1 + i % 3)
        assert permit is not None
        tokens.append(permit.token)
        sem.release(permit)
    assert tokens == sorted(set(tokens))


def test_blocked_waiters_are_woken_by_the_fair_order(redis_client, prefix):
    # A blocked waiter polls only every waiter_lease / 3 (20 s): within 10 s only a release's
    # wake-up (to the next group's head) gets it going.
    sem = grouped(redis_client, prefix, limit=1, waiter_lease=60)
    first = sem.acquire(group="a")
    assert first is not None
    order: list[str] = []
    threads = []
    for pid, group in [("a-1", "a"), ("a-2", "a"), ("b-1", "b")]:

        def run(pid: str = pid, group: str = group) -> None:
            with sem.hold(permit_id=pid, group=group):
                order.append(pid)

        assert isinstance(join(sem, pid, group), Waiting)  # joins in this order
        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()

    def blocked() -> bool:
        return sum(c.get("cmd") == "blpop" for c in redis_client.client_list()) >= 3

    wait_until(blocked, 10, what="the three waiters to block")
    sem.release(first)
    wait_until(lambda: len(order) == 3, 10, what="each to be woken in turn")
    for t in threads:
        t.join(10)
    assert order == ["b-1", "a-1", "a-2"]  # b has had no grant; a one


def test_every_key_has_a_ttl_shares_one_slot_and_is_gone_after_it(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=1, lease=0.4, waiter_lease=0.4, idle_ttl=0.5)
    sem.acquire(group="a")
    for i, group in enumerate("abcd"):
        join(sem, f"w{i}", group)
    keys = list(redis_client.scan_iter(match=f"{prefix}:*"))
    assert len(keys) >= 10  # holders, fair, fq, and each group's line, leases, tag, holders
    slot = key_slot(SemaphoreKeys(prefix, "fair").holders.encode())
    assert {key_slot(k) for k in keys} == {slot}
    assert all(redis_client.pttl(k) > 0 for k in keys)
    wait_until(
        lambda: not list(redis_client.scan_iter(match=f"{prefix}:*")), 10, what="keys to expire"
    )


def test_without_a_group_the_fifo_scripts_run(redis_client, prefix):
    plain = FairSemaphore(redis_client, "plain", 1, prefix=prefix)
    assert (
        plain.attempt_command("p")[1]
        == FairSemaphore.attempt_command.__globals__["ACQUIRE"].sha_bytes
    )
    sem = grouped(redis_client, prefix)
    assert sem.attempt_command("p", group="g")[1] != plain.attempt_command("p")[1]
    assert plain.groups() == []


@pytest.mark.parametrize(
    ("build", "call", "message"),
    [
        ({}, {"group": "g"}, "not grouped"),
        ({}, {"weight": 2.0}, "only with a group"),
        ({"grouped": True}, {}, "needs a group"),
        ({"grouped": True}, {"group": ""}, "needs a group"),
        ({"grouped": True}, {"group": "g", "weight": 0}, "weight must be"),
        ({"grouped": True}, {"group": "g", "weight": float("nan")}, "weight must be"),
        ({"grouped": True}, {"group": "g" * 300}, "characters long"),
        ({"grouped": True}, {"group": "a\0b"}, "NUL"),
    ],
)
def test_bad_groups_and_weights_are_refused_by_name(redis_client, prefix, build, call, message):
    sem = FairSemaphore(redis_client, "bad", 2, prefix=prefix, **build)
    with pytest.raises(ConfigurationError, match=message) as info:
        sem.attempt("p", **call)
    assert info.value.name == "bad"


def test_group_limit_needs_a_grouped_semaphore(redis_client):
    with pytest.raises(ConfigurationError, match="grouped=True"):
        FairSemaphore(redis_client, "x", 2, group_limit=1)
    with pytest.raises(ConfigurationError, match="group_limit"):
        FairSemaphore(redis_client, "x", 2, grouped=True, group_limit=0)


def test_a_grant_refreshed_past_the_idle_ttl_still_counts_for_its_group(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=3, group_limit=1, lease=0.6, idle_ttl=0.4)
    permit = sem.acquire(group="a")
    assert permit is not None
    server_ms = int(redis_client.time()[0]) * 1000
    deadline = server_ms + 3000  # several leases and idle TTLs from now

    def refreshed_past_deadline() -> bool:
        nonlocal permit
        permit = sem.refresh(permit)  # type: ignore[arg-type]
        return int(redis_client.time()[0]) * 1000 > deadline

    wait_until(refreshed_past_deadline, 10, interval=0.1, what="refreshes past the idle TTL")
    assert sem.acquire(group="a") is None  # a still holds its one
    assert isinstance(sem.acquire(group="b"), Permit)
    assert sem.release(permit)  # type: ignore[arg-type]
    assert isinstance(sem.acquire(group="a"), Permit)


def test_a_waiter_that_never_comes_back_drops_out_of_the_fair_line(redis_client, prefix):
    sem = grouped(redis_client, prefix, limit=1)
    held = sem.acquire(group="a")
    assert held is not None
    gone = sem.attempt("b-0", join_line=True, group="b", waiter_lease=2)  # never comes back
    assert isinstance(gone, Waiting)
    assert isinstance(join(sem, "c-0", "c"), Waiting)
    assert sem.release(held)
    # b-0's group is first (same start, b before c): the permit is its for now; once its
    # waiter lease ends c-0 gets it, and b leaves the groups.
    assert isinstance(join(sem, "c-0", "c"), Waiting)
    granted = wait_until(lambda: isinstance(join(sem, "c-0", "c"), Permit), 5, what="c-0")
    assert granted
    assert [g.group for g in sem.groups()] == ["c"]
