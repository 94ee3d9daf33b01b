"""What users of other locks expect, on the sync semaphore: ``locked()`` and extending a held
permit by a given lease (the asyncio side is in test_asyncio.py)."""

from __future__ import annotations

import pytest
import redis

from celery_redsem import ConfigurationError, FairSemaphore, Lock, PermitLost
from tests.servers import wait_until


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_locked_says_whether_any_permit_is_held(redis_client, prefix):
    sem = FairSemaphore(redis_client, "busy", 2, prefix=prefix)
    assert not sem.locked()
    first = sem.acquire()
    assert first is not None
    assert sem.locked()  # any holder, not only a full semaphore
    second = sem.acquire()
    assert second is not None
    sem.release(first)
    assert sem.locked()
    sem.release(second)
    assert not sem.locked()


def test_locked_goes_by_the_servers_clock_not_by_unswept_entries(redis_client, prefix):
    lock = Lock(redis_client, "lapsed", prefix=prefix, lease=0.2)
    permit = lock.acquire()
    assert permit is not None
    wait_until(lambda: server_ms(redis_client) > permit.expires_at, 5, what="the lease to end")
    assert redis_client.hexists(lock.keys.holders, permit.id)  # still there, not yet swept
    assert not lock.locked()


def test_refresh_extends_a_permit_by_a_given_lease_and_keeps_it(redis_client, prefix):
    lock = Lock(redis_client, "extended", prefix=prefix, lease=1)
    permit = lock.acquire()
    assert permit is not None
    longer = lock.refresh(permit, lease=120)
    assert longer.lease == 120.0
    assert (longer.id, longer.token) == (permit.id, permit.token)
    assert 110_000 < longer.expires_at - server_ms(redis_client) <= 121_000
    [holder] = lock.holders()
    assert holder.expires_at == longer.expires_at
    again = lock.refresh(longer)  # its own lease is now 120 s
    assert again.lease == 120.0
    assert again.expires_at - server_ms(redis_client) > 110_000
    shorter = lock.refresh(again, lease=0.5)  # shortening works too
    assert shorter.expires_at - server_ms(redis_client) <= 600
    wait_until(lambda: lock.acquire() is not None, 5, what="the shortened lease to end")
    with pytest.raises(PermitLost):
        lock.refresh(shorter, lease=60)


@pytest.mark.parametrize("lease", [0, -1, float("nan"), True, "10", 10**9])
def test_refresh_refuses_a_bad_lease_before_sending(redis_client, prefix, lease):
    lock = Lock(redis_client, "bad-lease", prefix=prefix)
    permit = lock.acquire()
    assert permit is not None
    with pytest.raises(ConfigurationError, match="lease must be a number of seconds"):
        lock.refresh(permit, lease=lease)
    assert lock.refresh(permit).lease == lock.lease


def test_a_valkey_py_client_is_refused_with_a_clear_error(redis_url):
    """valkey-py is not supported (its errors and cluster class are not redis-py's): said at
    construction, not by a failure later."""
    valkey = pytest.importorskip("valkey")
    client = valkey.Valkey.from_url(redis_url)
    try:
        with pytest.raises(ConfigurationError, match=r"client must be a redis\.Redis.*valkey"):
            Lock(client, "valkey")
    finally:
        client.close()
