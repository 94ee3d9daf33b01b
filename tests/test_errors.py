"""Which Redis errors a task waits out (transient) and which fail it at once.

Server errors are built from the error reply as redis-py parses it off the wire (the installed
redis-py's parser: before 7.2 it keeps no ``status_code``, and drops a code it knows, ``ERR``
among them, from the message), or come from a real server.
"""

from __future__ import annotations

import pytest
import redis.exceptions as e
from redis._parsers.base import BaseParser

from celery_redsem import BackendError
from celery_redsem.core.connections import error_code
from celery_redsem.core.errors import is_transient


def reply(text: str) -> Exception:
    """The exception redis-py raises for the error reply ``text``."""
    error: Exception = BaseParser.parse_error(text)
    return error


@pytest.mark.parametrize(
    "error",
    [
        e.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        e.TimeoutError("Timeout reading from socket"),
        reply("LOADING Redis is loading the dataset in memory"),
        reply("BUSY Redis is busy running a script. You can only call SCRIPT KILL"),
        reply("READONLY You can't write against a read only replica."),
        reply("OOM command not allowed when used memory > 'maxmemory'."),
        reply("MISCONF Redis is configured to save RDB snapshots, but it's currently unable"),
        reply("NOREPLICAS Not enough good replicas to write."),
        reply("CLUSTERDOWN The cluster is down"),
        reply("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
        reply("TRYAGAIN Multiple keys request during rehashing of slot"),
        reply("MOVED 3999 127.0.0.1:6381"),
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
        reply("WRONGPASS invalid username-password pair or user is disabled."),
        reply("NOAUTH Authentication required."),
        reply("NOPERM User app has no permissions to run the 'evalsha' command"),
        reply("ERR user_script:12: attempt to compare nil with number script: 4f3c"),
        reply("ERR unknown command 'FCALL', with args beginning with:"),
        reply("WRONGTYPE Operation against a key holding the wrong kind of value"),
        reply("CROSSSLOT Keys in request don't hash to the same slot"),
        e.DataError("Invalid input of type: 'NoneType'."),
        e.RedisError("Invalid SSL Certificate Requirements Flag: always"),
    ],
    ids=lambda error: type(error).__name__ + ":" + str(error)[:12],
)
def test_refusals_no_retry_can_fix_are_not(error: Exception) -> None:
    assert not is_transient(error)


def test_a_refusal_behind_another_error_is_not_transient() -> None:
    # redis-py's cluster client: no node could be reached because every node refused.
    with pytest.raises(e.RedisClusterException) as raised:
        raise e.RedisClusterException("cannot be connected") from reply("WRONGPASS invalid")
    assert not is_transient(raised.value)


def test_a_backend_error_is_as_transient_as_its_cause() -> None:
    assert BackendError("Redis failed").transient  # no cause known: assume an outage
    for cause, transient in [(e.ConnectionError("down"), True), (reply("NOPERM no"), False)]:
        with pytest.raises(BackendError) as raised:
            raise BackendError("Redis failed") from cause
        assert raised.value.transient is transient


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("ERR user_script:12: attempt to compare nil with number script: 4f3c", "ERR"),
        ("ERR unknown command 'FCALL', with args beginning with:", "ERR"),
        ("ERR Error running script (call to f_4f3c): @user_script:1: oops", "ERR"),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", "WRONGTYPE"),
        ("BUSY Redis is busy running a script. You can only call SCRIPT KILL", "BUSY"),
        ("MISCONF Redis is configured to save RDB snapshots", "MISCONF"),
        ("NOREPLICAS Not enough good replicas to write.", "NOREPLICAS"),
    ],
)
def test_the_code_of_an_error_reply_is_read_whatever_redis_py_keeps_of_it(
    text: str, code: str
) -> None:
    assert error_code(reply(text)) == code


def test_an_error_that_is_no_reply_has_no_code() -> None:
    assert error_code(e.ConnectionError("Error 111 connecting")) is None
    assert error_code(ValueError("no")) is None


def test_script_errors_from_a_real_server_are_refusals(redis_client) -> None:
    # What a bug in a script looks like (redis-py before 7.2 gives a bare ResponseError whose
    # message has lost its "ERR "): retrying it until max_wait would only hide it.
    with pytest.raises(e.ResponseError) as raised:
        redis_client.eval("return 1 + nil", 0)
    assert error_code(raised.value) == "ERR"
    assert not is_transient(raised.value)
    with pytest.raises(e.ResponseError) as raised:
        redis_client.eval("return redis.error_reply('ERR refresh.lua: out of bounds')", 0)
    assert not is_transient(raised.value)


def test_a_pipelines_errors_keep_their_code(redis_client) -> None:
    # redis-py's pipeline puts "Command # 1 (...) of pipeline caused error: " before the reply.
    for script, transient in [
        ("return redis.error_reply('ERR boom')", False),
        ("return redis.error_reply('WRONGTYPE not a hash')", False),
        ("return redis.error_reply('BUSY try later')", True),
        ("return redis.error_reply('TRYAGAIN NOW in a while')", True),
    ]:
        pipe = redis_client.pipeline(transaction=False)
        pipe.eval(script, 0)
        with pytest.raises(e.ResponseError) as raised:
            pipe.execute()
        assert is_transient(raised.value) is transient, (script, raised.value)
