"""The Lua scripts checked against a tiny pure-Python model of a fair semaphore (leases long enough
never to expire), for random sequences of tries, queued tries and releases."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_redsem import FairSemaphore, Permit, Waiting

IDS = [f"t{i}" for i in range(6)]
op = st.one_of(
    st.tuples(st.just("attempt"), st.sampled_from(IDS), st.booleans()),
    st.tuples(st.just("release"), st.sampled_from(IDS), st.just(False)),
)


@dataclass
class Model:
    limit: int
    holders: dict[str, int] = field(default_factory=dict)
    line: list[str] = field(default_factory=list)

    def attempt(self, pid: str, join: bool) -> tuple[bool, int]:
        if pid in self.holders:
            return True, 0
        ahead = self.line.index(pid) if pid in self.line else len(self.line)
        if len(self.holders) + ahead < self.limit:
            if pid in self.line:
                self.line.remove(pid)
            self.holders[pid] = 0
            return True, 0
        if not join:
            return False, 0
        if pid not in self.line:
            self.line.append(pid)
        return False, self.line.index(pid) + 1

    def release(self, pid: str) -> bool:
        if self.holders.pop(pid, None) is not None:
            return True
        if pid in self.line:
            self.line.remove(pid)
            return True
        return False


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(limit=st.integers(1, 3), ops=st.lists(op, max_size=30))
def test_scripts_match_the_model(redis_client, prefix, limit, ops):
    sem = FairSemaphore(redis_client, uuid.uuid4().hex, limit, prefix=prefix, lease=60)
    model = Model(limit)
    tokens: dict[str, int] = {}
    last_token = 0
    for kind, pid, join in ops:
        if kind == "release":
            assert sem.release(pid) == model.release(pid)
            tokens.pop(pid, None)
            continue
        granted, position = model.attempt(pid, join)
        result = sem.attempt(pid, join_line=join)
        if granted:
            assert isinstance(result, Permit)
            if pid in tokens:
                assert result.token == tokens[pid]
            else:
                assert result.token > last_token
                tokens[pid] = last_token = result.token
        else:
            assert isinstance(result, Waiting)
            assert result.position == position
        state = sem.state()
        assert sorted(h.permit_id for h in state.holders) == sorted(model.holders)
        assert [w.permit_id for w in state.waiters] == model.line
        assert len(state.holders) <= limit
        counters = redis_client.hgetall(sem.keys.holders)
        assert int(counters[b":queued"]) == len(model.line)
        assert len(counters) == 6 + len(model.holders)
