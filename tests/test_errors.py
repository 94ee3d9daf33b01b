"""Which Redis errors a task waits out (transient) and which fail it at once."""

from __future__ import annotations

import pytest
import redis.exceptions as e

from celery_redsem import BackendError
from celery_redsem.errors import is_transient


@pytest.mark.parametrize(
    "error",
    [
        e.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        e.TimeoutError("Timeout reading from socket"),
        e.BusyLoadingError("Redis is loading the dataset in memory"),  # LOADING
        e.ResponseError("BUSY Redis is busy running a script."),
        e.ReadOnlyError("You can't write against a read only replica."),  # READONLY
        e.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),  # OOM
        e.ResponseError("NOREPLICAS Not enough good replicas to write."),
        e.ClusterDownError("The cluster is down"),  # CLUSTERDOWN
        e.MasterDownError("Link with MASTER is down"),  # MASTERDOWN
        e.TryAgainError("Multiple keys request during rehashing of slot"),  # TRYAGAIN
        e.MovedError("3999 127.0.0.1:6381"),
        e.ClusterError("TTL exhausted."),
        e.RedisClusterException("Redis Cluster cannot be connected."),
    ],
    ids=lambda error: type(error).__name__ + ":" + str(error)[:12],
)
def test_outages_failovers_and_a_busy_server_are_transient(error: Exception) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        e.AuthenticationError("invalid username-password pair or user is disabled."),
        e.AuthorizationError("Authorization error"),
        e.NoPermissionError("this user has no permissions to run the 'evalsha' command"),
        e.ResponseError("ERR user_script:12: attempt to compare nil with number"),
        e.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        e.DataError("Invalid input of type: 'NoneType'."),
        e.RedisError("Invalid SSL Certificate Requirements Flag: always"),
    ],
    ids=lambda error: type(error).__name__ + ":" + str(error)[:12],
)
def test_refusals_no_retry_can_fix_are_not(error: Exception) -> None:
    assert not is_transient(error)


def test_a_backend_error_is_as_transient_as_its_cause() -> None:
    assert BackendError("Redis failed").transient  # no cause known: assume an outage
    for cause, transient in [(e.ConnectionError("down"), True), (e.NoPermissionError("no"), False)]:
        with pytest.raises(BackendError) as raised:
            raise BackendError("Redis failed") from cause
        assert raised.value.transient is transient
