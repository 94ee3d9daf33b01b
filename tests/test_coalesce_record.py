"""The newest-wins record (``coalesce.lua``) on a real server: one pending run that absorbs
sends and keeps their newest arguments, taken over by the run that holds its permit, debounce
on the server clock, and a TTL on the key whatever happens; and the decorator options that
turn it on, checked as the task is decorated."""

from __future__ import annotations

import json
import time

import pytest
import redis

from celery_redsem import ConfigurationError, FairSemaphore, with_lock, with_semaphore
from celery_redsem.core.marks import Arguments, CoalesceRecord, Debounce
from tests.servers import wait_until

NO_DEBOUNCE = Debounce()


def _args(text: str) -> Arguments:
    return Arguments(text.encode(), "application/json", "utf-8")


def _record(client: redis.Redis, prefix: str) -> CoalesceRecord:
    return CoalesceRecord(client, "doc", prefix=prefix)


def _key(prefix: str) -> str:
    return f"{prefix}:{{doc}}:dedupe"


def test_sends_while_a_run_is_pending_are_absorbed_and_the_run_takes_the_newest(
    redis_client, prefix
):
    record = _record(redis_client, prefix)
    first = record.send("a", _args("1"), 60, NO_DEBOUNCE, own_id=False)
    assert (first.status, first.task_id, first.delay) == ("publish", "a", 0.0)
    assert record.send("b", _args("2"), 60, NO_DEBOUNCE, own_id=False).task_id == "a"
    absorbed = record.send("c", _args("3"), 60, NO_DEBOUNCE, own_id=True)  # an explicit id
    assert (absorbed.status, absorbed.task_id) == ("absorbed", "a")
    assert record.receive("a", _args("1"), 60, NO_DEBOUNCE, canvas=False).status == "known"
    by_name = record.receive("x", _args("4"), 60, NO_DEBOUNCE, canvas=False)
    assert (by_name.status, by_name.task_id) == ("absorbed", "a")
    state = record.state()
    assert (state.running, state.pending, state.answers) == (None, "a", 2)
    assert 0 < redis_client.pttl(_key(prefix)) <= 60_000
    started = record.start("a", "a", _args("1"), 60, NO_DEBOUNCE, canvas=False)
    assert started.status == "run"
    assert started.arguments == _args("4")  # the newest
    assert started.answers == ("c", "x")  # (sorted by the hash, not by time)
    assert record.state().running == "a"
    # Repeated (a client's retry after a lost reply, a redelivery): the same answer.
    assert record.start("a", "a", _args("1"), 60, NO_DEBOUNCE, canvas=False) == started
    # A send now starts the next pending run; the running run answers for c and x.
    assert record.send("d", _args("5"), 60, NO_DEBOUNCE, own_id=False).status == "publish"
    assert sorted(record.finish("a")) == ["c", "x"]
    assert record.finish("a") == []  # once
    assert record.start("d", "d", _args("5"), 60, NO_DEBOUNCE, canvas=False).answers == ()
    assert record.finish("d") == []
    assert not redis_client.exists(_key(prefix))


def test_a_running_run_with_a_live_permit_holds_the_pending_one_back(redis_client, prefix):
    sem = FairSemaphore(redis_client, "doc", 2, lease=30, prefix=prefix)
    record = _record(redis_client, prefix)
    record.send("a", _args("1"), 60, NO_DEBOUNCE, own_id=False)
    permit = sem.acquire(permit_id="a")
    assert permit is not None
    assert record.start("a", "a", _args("1"), 60, NO_DEBOUNCE, canvas=False).status == "run"
    assert record.state().running_live
    record.send("b", _args("2"), 60, NO_DEBOUNCE, own_id=False)
    waiting = record.start("b", "b", _args("2"), 60, NO_DEBOUNCE, canvas=False)
    assert waiting.status == "wait"
    assert 0 < waiting.delay <= 1
    assert record.keep("a", "a", 60) is True
    sem.release(permit)  # its lease is gone: the pending run may go
    assert not record.state().running_live
    assert record.start("b", "b", _args("2"), 60, NO_DEBOUNCE, canvas=False).status == "run"
    assert record.keep("a", "a", 60) is False  # not the running run any more


def test_a_canvas_step_takes_a_plain_pending_runs_place_and_is_never_absorbed(redis_client, prefix):
    record = _record(redis_client, prefix)
    record.receive("plain", _args("1"), 60, NO_DEBOUNCE, canvas=False)
    took = record.receive("step", _args("2"), 60, NO_DEBOUNCE, canvas=True)
    assert (took.status, took.task_id) == ("took", "plain")
    assert record.send("later", _args("3"), 60, NO_DEBOUNCE, own_id=False).task_id == "step"
    behind = record.receive("step2", _args("4"), 60, NO_DEBOUNCE, canvas=True)
    assert (behind.status, behind.task_id) == ("queued", "step")
    # The plain run's message ends absorbed; the second step waits its turn.
    plain = record.start("plain", "plain", _args("1"), 60, NO_DEBOUNCE, canvas=False)
    assert (plain.status, plain.task_id) == ("absorbed", "step")
    step2 = record.start("step2", "step2", _args("4"), 60, NO_DEBOUNCE, canvas=True)
    assert step2.status == "wait"
    step = record.start("step", "step", _args("2"), 60, NO_DEBOUNCE, canvas=True)
    assert (step.arguments, step.answers) == (_args("3"), ("plain",))
    assert record.finish("step") == ["plain"]
    # The plain run's message, coming only now (it waited for the lock), still ends absorbed.
    late = record.start("plain", "plain", _args("1"), 60, NO_DEBOUNCE, canvas=False)
    assert late.status == "absorbed"
    assert record.start("step2", "step2", _args("4"), 60, NO_DEBOUNCE, canvas=True).status == "run"


def test_debounce_defers_the_run_until_the_key_is_quiet_bounded_by_debounce_max(
    redis_client, prefix
):
    record = _record(redis_client, prefix)
    quiet = Debounce(0.4, 0.6)
    sent = record.send("a", _args("1"), 60, quiet, own_id=False)
    assert (sent.status, sent.delay) == ("publish", 0.4)
    early = record.start("a", "a", _args("1"), 60, quiet, canvas=False)
    assert early.status == "defer"
    assert 0.3 < early.delay <= 0.4
    began = time.monotonic()
    # Sends keep coming: each pushes the start back, but never past debounce_max.
    while time.monotonic() - began < 0.8:
        record.send("b", _args("2"), 60, quiet, own_id=False)
        assert record.state().due_in <= 0.6
        time.sleep(0.05)  # (the scenario: a stream of sends)
    started = wait_until(
        lambda: (
            (d := record.start("a", "a", _args("1"), 60, quiet, canvas=False)).status == "run" and d
        ),
        5,
        what="the run to be due",
    )
    assert started.arguments == _args("2")
    assert 0 < redis_client.pttl(_key(prefix)) <= 61_000


def test_a_lost_pending_run_leaves_its_sends_to_the_next_one(redis_client, prefix):
    record = _record(redis_client, prefix)
    record.send("r", _args("0"), 60, NO_DEBOUNCE, own_id=False)
    record.start("r", "r", _args("0"), 60, NO_DEBOUNCE, canvas=False)  # the key lives on
    record.send("lost", _args("1"), 0.05, NO_DEBOUNCE, own_id=False)
    record.send("b", _args("2"), 0.05, NO_DEBOUNCE, own_id=True)
    # The pending run's message never comes: after its TTL a send starts another, which
    # answers for what the lost one had absorbed.
    again = wait_until(
        lambda: (
            (d := record.send("c", _args("3"), 60, NO_DEBOUNCE, own_id=False)).status == "publish"
            and d
        ),
        5,
        what="the pending run to lapse",
    )
    assert again.task_id == "c"
    assert record.start("c", "c", _args("3"), 60, NO_DEBOUNCE, canvas=False).answers == ("b",)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dedupe": "coalesced"}, r"dedupe of .* must be False, True, 'raise' or 'coalesce'"),
        ({"dedupe": True, "debounce": 1.0}, r"debounce of .* needs dedupe='coalesce'"),
        ({"dedupe": "coalesce", "debounce": 0}, r"debounce of .* must be a number of seconds"),
        ({"dedupe": "coalesce", "debounce": "1"}, r"debounce of .* must be a number of seconds"),
        ({"dedupe": "coalesce", "debounce_max": 5.0}, r"debounce_max of .* needs debounce="),
        (
            {"dedupe": "coalesce", "debounce": 2.0, "debounce_max": 1.0},
            r"debounce_max of .* \(1.0s\) must be at least its debounce \(2.0s\)",
        ),
    ],
)
def test_bad_coalesce_options_fail_at_decoration(options, message):
    def rebuild(doc: str) -> None: ...

    with pytest.raises(ConfigurationError, match=message):
        with_lock(key="k", **options)(rebuild)
    with pytest.raises(ConfigurationError, match=message):
        with_semaphore(3, key="k", **options)(rebuild)


def test_status_shows_a_keys_running_and_pending_runs(redis_url, redis_client, prefix):
    from celery import Celery
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_redsem.integration.settings import reset
    from celery_redsem.ops.cli import redsem

    app = Celery("coalesce-status", broker="memory://", set_as_current=False)
    app.conf.update(redsem_redis_url=redis_url, redsem_key_prefix=prefix)

    def status(*args: str) -> str:
        obj = CLIContext(app=app, no_color=True, workdir=None)
        result = CliRunner().invoke(redsem, ["status", "doc", *args], obj=obj)
        assert result.exit_code == 0, result.output
        return result.output

    try:
        assert "No semaphore" in status()
        record = _record(redis_client, prefix)
        record.send("a", _args("1"), 60, Debounce(30), own_id=False)
        record.send("b", _args("2"), 60, Debounce(30), own_id=True)
        assert "runs: running -; pending a (due in 30.0s, answers for 1 more)" in status()
        sem = FairSemaphore(redis_client, "doc", 1, lease=30, prefix=prefix)
        assert sem.acquire(permit_id="r") is not None
        record.send("r", _args("0"), 60, NO_DEBOUNCE, own_id=False)  # (absorbed by a)
        redis_client.hset(_key(prefix), mapping={"id": "r", "run": "r"})  # r runs
        out = status()
        assert "runs: running r; pending a" in out
        assert "holder  r" in out
        runs = json.loads(status("--json"))["runs"]
        assert (runs["running"], runs["running_live"], runs["pending"]) == ("r", True, "a")
    finally:
        reset(app)
