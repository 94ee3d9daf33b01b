"""Rate limiters on a real 3-primary Redis Cluster: every limiter's keys in one slot, limiters
on every node, listed by a SCAN of every node."""

from __future__ import annotations

from typing import Any

import pytest

from celery_redsem import RateLimiter
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.ops.admin import rate_states

pytestmark = pytest.mark.slow


def test_rate_limiters_work_on_every_node(cluster_client: Any, scale_prefix: str) -> None:
    names = [f"api:{i}" for i in range(24)]
    keys = [SemaphoreKeys(scale_prefix, name) for name in names]
    assert {cluster_client.get_node_from_key(k.rate).name for k in keys} == {
        node.name for node in cluster_client.get_primaries()
    }, "the names must land on every primary"
    assert all(cluster_client.keyslot(k.rate) == cluster_client.keyslot(k.rate_line) for k in keys)
    # At 1/s: the 24 calls of each round (72 in all, on a loaded host) take well under the
    # interval, so the second attempt of each is still refused and books.
    limiters = [RateLimiter(cluster_client, n, "1/s", prefix=scale_prefix) for n in names]
    assert all(limiter.attempt("first") for limiter in limiters)
    booked = [limiter.attempt("second", book=True) for limiter in limiters]
    assert all(r.booked and 0 < r.retry_after <= 1.0 for r in booked)
    reserved = [limiter.attempt("third", reserve=True) for limiter in limiters]
    assert all(r.booked and 1.0 < r.retry_after <= 2.0 for r in reserved)
    found = rate_states(cluster_client, prefix=scale_prefix)
    assert sorted(s.name for s in found) == sorted(names)
    assert {(s.rate, s.burst, s.booked, s.remembered) for s in found} == {(1.0, 1, 2, 3)}
