"""Newest wins (issue 42): ``dedupe="coalesce"`` and ``debounce`` with a real ``celery worker``
(prefork, four slots), every send from a separate process that only imports the tasks module
(:mod:`tests.integration.apps.coalesce_sender`)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redsem.core.marks import CoalesceRecord
from tests.integration.conftest import ROOT, WorkerProcess, running_beat, running_workers
from tests.servers import wait_until

pytestmark = pytest.mark.slow

APP_MODULE = "tests.integration.apps.coalesce_tasks"


@pytest.fixture(scope="module")
def workers(
    redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path_factory.mktemp("coalesce-workers"),
        ["c0"],
        4,
        app_module=APP_MODULE,
    ) as procs:
        yield procs


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    found = redis.Redis.from_url(redis_url)
    yield found
    found.close()


def _scenario(redis_url: str, prefix: str, name: str, *args: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "REDSEM_TEST_APP_URL": redis_url,
        "REDSEM_TEST_APP_PREFIX": prefix,
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.apps.coalesce_sender", name, *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert found.pop("finalized") is False  # the sender never finalized its app
    return found


def _bodies(client: redis.Redis, prefix: str, doc: str) -> list[dict[str, Any]]:
    return [json.loads(b) for b in client.lrange(f"{prefix}:c:bodies:{doc}", 0, -1)]


def _versions(client: redis.Redis, prefix: str, doc: str) -> list[str]:
    return [b["version"] for b in _bodies(client, prefix, doc)]


def _record(client: redis.Redis, prefix: str, name: str) -> CoalesceRecord:
    return CoalesceRecord(client, name, prefix=prefix)


def test_five_sends_during_a_run_give_two_bodies_the_second_with_the_newest_arguments(
    redis_url: str, module_prefix: str, workers: list[WorkerProcess], client: redis.Redis
) -> None:
    doc = uuid.uuid4().hex[:10]
    found = _scenario(redis_url, module_prefix, "five_during_a_run", doc)
    first, *sends = found["ids"]
    assert len(set(sends)) == 1  # one pending run, whose id every send got
    assert first not in sends
    assert found["results"] == ["v0"] + ["v5"] * 5  # every .get() answered
    # Four sends absorbed by the pending run, each signalled and counted by their process.
    into = {"task": "c.rebuild", "task_id": sends[0], "absorbed_id": None, "debounced": False}
    assert found["signals"] == [{**into, "name": f"rebuild:{doc}"}] * 4
    assert found["counted"]["c.rebuild"] == {"coalesced": 4.0, "debounced": 0.0}
    assert _versions(client, module_prefix, doc) == ["v0", "v5"]
    state = _record(client, module_prefix, f"rebuild:{doc}").state()
    assert (state.pending, state.answers) == (None, 0)


def test_a_failing_carrying_run_fails_every_send_it_carried(
    redis_url: str, module_prefix: str, workers: list[WorkerProcess], client: redis.Redis
) -> None:
    doc = uuid.uuid4().hex[:10]
    found = _scenario(redis_url, module_prefix, "five_during_a_run", doc, "fail5")
    first, *rest = found["results"]
    assert first == "v0"
    assert rest == [{"error": "RuntimeError", "message": "failed fail5"}] * 5


def test_five_debounced_sends_give_one_body_with_the_last_arguments_after_the_quiet_time(
    redis_url: str, module_prefix: str, workers: list[WorkerProcess], client: redis.Redis
) -> None:
    doc = uuid.uuid4().hex[:10]
    found = _scenario(redis_url, module_prefix, "debounce", doc)
    assert found["results"] == ["v4"] * 5
    assert [s["debounced"] for s in found["signals"]] == [True] * 4
    assert found["counted"]["c.debounced"] == {"coalesced": 0.0, "debounced": 4.0}
    (body,) = _bodies(client, module_prefix, doc)
    assert body["version"] == "v4"
    assert body["at"] >= found["last_sent"] + 0.5  # server clock, both


def test_debounce_max_runs_a_stream_that_never_goes_quiet(
    redis_url: str, module_prefix: str, workers: list[WorkerProcess], client: redis.Redis
) -> None:
    doc = uuid.uuid4().hex[:10]
    found = _scenario(redis_url, module_prefix, "debounce_max", doc)
    bodies = _bodies(client, module_prefix, doc)
    assert len(bodies) >= 2  # without debounce_max: one run, after the stream
    assert bodies[0]["at"] >= found["first_sent"] + 0.3
    assert bodies[-1]["version"] == "v29"
    ran = {b["version"] for b in bodies}
    assert all(result in ran for result in found["results"])
    assert found["results"][-1] == "v29"


def test_send_task_and_a_canvas_step_coalesce_and_the_canvas_goes_on(
    redis_url: str, module_prefix: str, workers: list[WorkerProcess], client: redis.Redis
) -> None:
    doc = uuid.uuid4().hex[:10]
    found = _scenario(redis_url, module_prefix, "other_ways", doc)
    # first, send_task (absorbed by the canvas step), the step, its chain, a send absorbed by
    # the step, another send_task absorbed by it (the newest arguments: v4)
    assert found["results"] == ["v0", "v4", "v4", "after", "v4", "v4"]
    assert found["later_id"] == found["step_id"]
    assert _versions(client, module_prefix, doc) == ["v0", "v4"]


def test_beat_sends_coalesce_behind_the_running_run(
    redis_url: str,
    module_prefix: str,
    workers: list[WorkerProcess],
    client: redis.Redis,
    tmp_path: Path,
) -> None:
    # A job scheduled four times as often as it takes: one run at a time, one pending behind
    # it, nothing piled up.
    doc = uuid.uuid4().hex[:10]
    entry = {
        "task": "c.rebuild",
        "schedule": 0.25,
        "args": [doc, "beat"],
        "kwargs": {"seconds": 1.0},
    }
    with running_beat(redis_url, module_prefix, tmp_path, {"again": entry}, APP_MODULE) as (
        beat,
        log,
    ):

        def sends() -> int:
            return log.read_text(errors="replace").count("Sending due task again")

        wait_until(lambda: sends() >= 12 or beat.poll() is not None, 60, what="beat's sends")
        assert beat.poll() is None, log.read_text()
    sent = sends()
    record = _record(client, module_prefix, f"rebuild:{doc}")

    def settled() -> bool:
        state = record.state()
        return state.pending is None and not state.running_live

    wait_until(settled, 30, what="the last run to end")
    starts = [b["at"] for b in _bodies(client, module_prefix, doc)]
    assert 2 <= len(starts) <= sent // 2
    assert all(later - earlier >= 0.99 for earlier, later in itertools.pairwise(starts))


def test_a_killed_run_loses_no_pending_run(
    redis_url: str, module_prefix: str, workers: list[WorkerProcess], client: redis.Redis
) -> None:
    doc = uuid.uuid4().hex[:10]
    found = _scenario(redis_url, module_prefix, "killed", doc)
    lost, *sends = found["results"]
    assert lost["error"] == "WorkerLostError"
    assert sends == ["v3"] * 3
    assert _versions(client, module_prefix, doc) == ["v0", "v3"]


def test_a_killed_worker_loses_no_pending_run(
    redis_url: str,
    module_prefix: str,
    workers: list[WorkerProcess],
    client: redis.Redis,
    tmp_path: Path,
) -> None:
    # The whole worker (main process and children) is SIGKILLed while one run holds the key
    # and the pending run's message waits in its other slot: both messages (acks_late) come
    # back to another worker once the broker's visibility timeout ends.
    doc = uuid.uuid4().hex[:10]
    transport = {
        "global_keyprefix": f"{module_prefix}:kombu:",
        "visibility_timeout": 3,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
    late = ["-Q", "coalesce-late"]
    conf = {"broker_transport_options": transport}
    doomed = WorkerProcess(
        redis_url, module_prefix, "k0", 2, tmp_path / "k0.log", *late, conf=conf,
        app_module=APP_MODULE,
    )  # fmt: skip
    try:
        doomed.wait_ready()
        first, *sends = _scenario(redis_url, module_prefix, "before_the_kill", doc)["ids"]
        received = f"c.rebuild_late[{sends[0]}] received"
        wait_until(lambda: received in doomed.log(), 30, what="the pending run received")
        os.killpg(doomed.proc.pid, signal.SIGKILL)
    finally:
        doomed.stop()
    with running_workers(
        redis_url, module_prefix, tmp_path, ["k1"], 2, *late, app_module=APP_MODULE, **conf
    ):
        found = _scenario(redis_url, module_prefix, "after_the_kill", doc, first, *sends)
    assert found["results"] == ["v0", "v3", "v3", "v3"]
    assert set(sends) == {sends[0]}
    versions = _versions(client, module_prefix, doc)
    assert versions[0] == "v0"  # the body killed
    assert sorted(versions[1:]) == ["v0", "v3"]  # its run again, and the pending run's


def test_arguments_over_the_limit_fail_visibly(
    redis_url: str, module_prefix: str, workers: list[WorkerProcess], client: redis.Redis
) -> None:
    doc = uuid.uuid4().hex[:10]
    found = _scenario(redis_url, module_prefix, "too_large", doc)
    assert found["raised"].startswith("ConfigurationError: the arguments of c.rebuild for")
    assert "at most 65536 bytes" in found["raised"]
    assert found["by_name"]["error"] == "ConfigurationError"
    assert _bodies(client, module_prefix, doc) == []
