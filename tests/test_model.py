"""The Lua scripts checked against a tiny pure-Python model of a fair semaphore (leases long enough
never to expire), for random sequences of tries, queued tries (present, or away on a long
countdown), releases, and lost keys."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_redsem import FairSemaphore, Permit, Waiting

IDS = [f"t{i}" for i in range(6)]
# An attempt to try once, to wait in line, or to wait away on a countdown; or a release; or
# the loss of a key (an eviction, a DEL): of the line's due times (every place counts as due
# then), or of the holders hash (its permits are gone; the line carries on).
op = st.one_of(
    st.tuples(st.just("attempt"), st.sampled_from(IDS), st.sampled_from(["try", "wait", "away"])),
    st.tuples(st.just("release"), st.sampled_from(IDS), st.just("")),
    st.tuples(st.just("lose_due_times"), st.just(""), st.just("")),
    st.tuples(st.just("lose_holders"), st.just(""), st.just("")),
)


@dataclass
class Model:
    limit: int
    holders: dict[str, int] = field(default_factory=dict)
    line: list[str] = field(default_factory=list)
    away: set[str] = field(default_factory=set)  # waiters on a countdown: hold no permit

    def attempt(self, pid: str, mode: str) -> tuple[bool, int]:
        if pid in self.holders:
            return True, 0
        before = self.line[: self.line.index(pid)] if pid in self.line else self.line
        ahead = sum(1 for w in before if w not in self.away)
        if len(self.holders) + ahead < self.limit:
            if pid in self.line:
                self.line.remove(pid)
                self.away.discard(pid)
            self.holders[pid] = 0
            return True, 0
        if mode == "try":
            return False, 0
        if pid not in self.line:
            self.line.append(pid)
        if mode == "away":
            self.away.add(pid)
        else:
            self.away.discard(pid)
        return False, self.line.index(pid) + 1

    def lose_due_times(self) -> None:
        self.away.clear()  # a place with no due time counts as due until its waiter is back

    def release(self, pid: str) -> bool:
        if self.holders.pop(pid, None) is not None:
            return True
        if pid in self.line:
            self.line.remove(pid)
            self.away.discard(pid)
            return True
        return False


def check_reply(
    result: Permit | Waiting,
    granted: bool,
    position: int,
    pid: str,
    tokens: dict[str, int],
    last_token: int,
) -> int:
    """Check an attempt's reply against the model's answer (``granted``, ``position``): a
    holder keeps its token, a new grant gets a higher one. Returns the last token granted."""
    if not granted:
        assert isinstance(result, Waiting)
        assert result.position == position
        return last_token
    assert isinstance(result, Permit)
    if pid in tokens:
        assert result.token == tokens[pid]
        return last_token
    assert result.token > last_token
    tokens[pid] = result.token
    return result.token


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(limit=st.integers(1, 3), ops=st.lists(op, max_size=30))
def test_scripts_match_the_model(redis_client, prefix, limit, ops):
    sem = FairSemaphore(redis_client, uuid.uuid4().hex, limit, prefix=prefix, lease=60)
    model = Model(limit)
    tokens: dict[str, int] = {}
    last_token = 0
    for kind, pid, mode in ops:
        if kind == "lose_holders":
            redis_client.delete(sem.keys.holders)
            model.holders.clear()
            tokens.clear()
            continue
        if kind == "lose_due_times":
            redis_client.delete(sem.keys.waiter_due)
            model.lose_due_times()
            continue
        if kind == "release":
            assert sem.release(pid) == model.release(pid)
            tokens.pop(pid, None)
            continue
        granted, position = model.attempt(pid, mode)
        back_in = 30.0 if mode == "away" else 0.0
        result = sem.attempt(pid, join_line=mode != "try", waiter_lease=60, back_in=back_in)
        last_token = check_reply(result, granted, position, pid, tokens, last_token)
        state = sem.state()
        assert sorted(h.permit_id for h in state.holders) == sorted(model.holders)
        assert [w.permit_id for w in state.waiters] == model.line
        assert len(state.holders) <= limit
        counters = redis_client.hgetall(sem.keys.holders)
        if not counters:  # lost, and no attempt since made it again
            continue
        assert int(counters[b":queued"]) == len(model.line)
        assert len(counters) == 7 + len(model.holders)
        gate = int(counters[b":gate"])  # the fast path is open only with nobody in line
        assert gate == 0 or (not model.line and gate <= int(counters[b":horizon"]))
