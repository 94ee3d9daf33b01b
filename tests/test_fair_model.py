"""The fair-share scripts checked against a tiny pure-Python model of a grouped semaphore
(start-time fair queueing over groups, FIFO within a group, a group limit; leases long enough
never to expire), for random sequences of tries, queued tries and releases."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_redsem import FairSemaphore
from tests.test_model import check_reply

IDS = [f"t{i}" for i in range(7)]
GROUPS = ["a", "b", "c"]
WEIGHTS = [1.0, 2.0, 0.5, 3.0]
op = st.one_of(
    st.tuples(
        st.just("attempt"),
        st.sampled_from(IDS),
        st.sampled_from(GROUPS),
        st.sampled_from(WEIGHTS),
        st.booleans(),  # join the line
    ),
    st.tuples(st.just("release"), st.sampled_from(IDS), st.just(""), st.just(1.0), st.just(False)),
)


@dataclass
class Model:
    limit: int
    group_limit: int | None
    holders: dict[str, str] = field(default_factory=dict)  # permit id -> group
    lines: dict[str, list[str]] = field(default_factory=dict)  # group -> FIFO line
    queued: dict[str, float] = field(default_factory=dict)  # group -> tag (may be served)
    capped: dict[str, float] = field(default_factory=dict)  # group -> tag (at its limit)
    finish: dict[str, float] = field(default_factory=dict)
    vt: float = 0.0

    def order(self) -> list[str]:
        return sorted(self.queued, key=lambda g: (self.queued[g], g))

    def held_by(self, group: str) -> int:
        return sum(1 for g in self.holders.values() if g == group)

    def leave(self, group: str, pid: str) -> bool:
        line = self.lines.get(group, [])
        if pid not in line:
            return False
        line.remove(pid)
        if not line:
            self.queued.pop(group, None)
            self.capped.pop(group, None)
        return True

    def park(self, group: str, capped: bool) -> None:
        if capped and group in self.queued:
            self.capped[group] = self.queued.pop(group)
        elif not capped and group in self.capped:
            self.queued[group] = max(self.capped.pop(group), self.vt)

    def attempt(self, pid: str, group: str, weight: float, join: bool) -> tuple[bool, int]:
        if pid in self.holders:
            return True, 0
        for other, line in self.lines.items():
            if other != group and pid in line:
                self.leave(other, pid)
        free = self.limit - len(self.holders)
        held = self.held_by(group)
        capped = self.group_limit is not None and held >= self.group_limit
        self.park(group, capped)
        line = self.lines.setdefault(group, [])
        in_line = pid in line
        waiting = group in self.queued or group in self.capped
        tag = self.queued.get(group, self.capped.get(group))
        if tag is None:
            tag = max(self.vt, self.finish.get(group, 0.0))
        eligible = False
        if free > 0 and not capped and (line[:1] == [pid] if in_line else not line):
            if waiting:
                ahead = self.order().index(group)
            else:
                ahead = sum(1 for g in self.queued if self.queued[g] <= tag)
            eligible = ahead < free
        if eligible:
            if in_line:
                line.remove(pid)
            self.finish[group] = tag + 1 / weight
            self.vt = max(self.vt, tag)
            self.queued.pop(group, None)
            self.capped.pop(group, None)
            if line:
                full = self.group_limit is not None and held + 1 >= self.group_limit
                (self.capped if full else self.queued)[group] = self.finish[group]
            self.holders[pid] = group
            return True, 0
        if not join:
            return False, 0
        if not in_line:
            line.append(pid)
            if not waiting:
                (self.capped if capped else self.queued)[group] = tag
        order = self.order()
        rank = order.index(group) if group in self.queued else len(order)
        return False, int(line.index(pid) * max(1, len(order)) / weight) + 1 + rank

    def release(self, pid: str) -> bool:
        group = self.holders.pop(pid, None)
        if group is not None:
            if self.group_limit is not None and self.held_by(group) < self.group_limit:
                self.park(group, False)
            return True
        return any(self.leave(g, pid) for g in list(self.lines))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    limit=st.integers(1, 3),
    group_limit=st.sampled_from([None, 1, 2]),
    ops=st.lists(op, min_size=15, max_size=60),
)
def test_fair_scripts_match_the_model(redis_client, prefix, limit, group_limit, ops):
    sem = FairSemaphore(
        redis_client,
        uuid.uuid4().hex,
        limit,
        prefix=prefix,
        lease=60,
        waiter_lease=60,
        grouped=True,
        group_limit=group_limit,
    )
    model = Model(limit, group_limit)
    tokens: dict[str, int] = {}
    last_token = 0
    for kind, pid, group, weight, join in ops:
        if kind == "release":
            assert sem.release(pid) == model.release(pid)
            tokens.pop(pid, None)
            continue
        granted, position = model.attempt(pid, group, weight, join)
        result = sem.attempt(pid, join_line=join, group=group, weight=weight)
        last_token = check_reply(result, granted, position, pid, tokens, last_token)
        groups = {g.group: (g.holders, g.waiting, g.at_limit) for g in sem.groups()}
        expected = {
            g: (model.held_by(g), len(model.lines.get(g, [])), g in model.capped)
            for g in GROUPS
            if model.held_by(g) or model.lines.get(g)
        }
        assert groups == expected
        assert sorted(h.permit_id for h in sem.holders()) == sorted(model.holders)
