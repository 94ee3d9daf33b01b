"""``celery redsem`` against a real server, through click's runner and celery's own command."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redsem import FairSemaphore, Lock, Permit
from celery_redsem.integration.settings import reset
from celery_redsem.ops.cli import redsem

#: Set by the ``app`` fixture so that ``celery -A tests.test_cli:cli_app`` finds it.
cli_app: Celery | None = None


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    global cli_app  # noqa: PLW0603
    app = Celery("redsem-cli-test", broker="memory://", set_as_current=False)
    app.conf.redsem_redis_url = redis_url
    app.conf.redsem_key_prefix = prefix
    cli_app = app
    yield app
    cli_app = None
    reset(app)


def run(app: Celery, *args: str, stdin: str | None = None) -> Result:
    obj = CLIContext(app=app, no_color=True, workdir=None)
    return CliRunner().invoke(redsem, list(args), obj=obj, input=stdin)


@pytest.fixture
def busy(redis_client: redis.Redis, prefix: str) -> dict[str, Permit]:
    """``market:alice`` full (2 of 2) with one waiter; ``report:1`` held by one task."""
    sem = FairSemaphore(redis_client, "market:alice", 2, prefix=prefix, lease=30)
    held = {pid: sem.acquire(permit_id=pid) for pid in ("task-a", "task-b")}
    sem.attempt("task-c", join_line=True)
    held["task-r"] = Lock(redis_client, "report:1", prefix=prefix, lease=30).acquire(
        permit_id="task-r"
    )
    assert all(isinstance(p, Permit) for p in held.values())
    return held  # type: ignore[return-value]


def test_the_entry_point_gives_celery_the_redsem_group():
    (ep,) = [ep for ep in entry_points(group="celery.commands") if ep.name == "redsem"]
    assert ep.load() is redsem
    from celery.bin.celery import celery

    assert celery.commands["redsem"] is redsem


def test_status_lists_holders_waiters_and_last_token(app, busy):
    result = run(app, "status")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "market:alice  limit 2  held 2/2  waiting 1" in out
    assert f"last token {busy['task-b'].token}" in out
    assert "holder  task-a" in out
    assert "waiter  #1  task-c" in out
    assert "report:1  limit 1  held 1/1" in out
    assert out.index("market:alice") < out.index("report:1")


def test_status_json_for_scripts(app, busy, prefix):
    result = run(app, "status", "--pattern", "market:*", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["prefix"], data["total"]) == (prefix, 1)
    (sem,) = data["semaphores"]
    assert sem["name"] == "market:alice"
    assert sem["limit"] == 2
    assert sem["last_token"] == busy["task-b"].token
    assert [h["permit_id"] for h in sem["holders"]] == ["task-a", "task-b"]
    assert all(25_000 < h["remaining_ms"] <= 30_000 for h in sem["holders"])
    assert [w["permit_id"] for w in sem["waiters"]] == ["task-c"]


def test_status_says_when_nothing_matches_and_caps_the_list(app, busy):
    assert "No semaphore" in run(app, "status", "-p", "nothing:*").output
    capped = run(app, "status", "--max", "1")
    assert "report:1" not in capped.output
    assert "... and 1 more" in capped.output


def test_inspect_one_semaphore(app, busy):
    result = run(app, "inspect", "market:alice")
    assert result.exit_code == 0, result.output
    assert "holders (2," in result.output
    assert "waiter  #1  task-c" in result.output
    data = json.loads(run(app, "inspect", "market:alice", "--json").output)
    assert data["exists"] is True
    assert data["key_ttls_ms"]
    assert all(ttl > 0 for ttl in data["key_ttls_ms"].values())


def test_inspect_an_unknown_semaphore_exits_1(app, busy):
    result = run(app, "inspect", "market:nobody")
    assert result.exit_code == 1
    assert "No semaphore 'market:nobody'" in result.output
    missing = run(app, "inspect", "market:nobody", "--json")
    assert missing.exit_code == 1
    assert json.loads(missing.stdout)["exists"] is False


def test_a_bad_name_is_a_one_line_error(app):
    result = run(app, "inspect", "bad{name}")
    assert result.exit_code == 1
    assert "must not contain" in result.output
    assert "Traceback" not in result.output


def test_release_frees_a_holder_logs_it_and_wakes_the_line(app, busy, redis_client, prefix, caplog):
    caplog.set_level(logging.INFO, logger="celery_redsem.ops.admin")
    result = run(app, "release", "market:alice", "task-a")
    assert result.exit_code == 0, result.output
    assert f"Released the permit of task-a in market:alice (token {busy['task-a'].token})" in (
        result.output
    )
    assert "force release by" in caplog.text
    assert "task-a" in caplog.text
    sem = FairSemaphore(redis_client, "market:alice", 2, prefix=prefix, lease=30)
    assert [h.permit_id for h in sem.holders()] == ["task-b"]
    # The waiter first in line gets the freed permit; the old grant cannot be refreshed.
    assert isinstance(sem.attempt("task-c", join_line=True), Permit)
    assert not sem.release(busy["task-a"])


def test_release_of_a_waiter_and_of_nothing(app, busy):
    waiter = run(app, "release", "market:alice", "task-c", "--json")
    assert json.loads(waiter.output)["released"] == "waiter"
    again = run(app, "release", "market:alice", "task-c")
    assert again.exit_code == 1
    assert "holds no permit and no place in line" in again.output


def test_purge_asks_first(app, busy, redis_client, prefix):
    refused = run(app, "purge", stdin="n\n")
    assert refused.exit_code == 1
    assert "2 semaphore(s)" in refused.output
    assert "3 live permit(s)" in refused.output
    assert any(redis_client.scan_iter(match=f"{prefix}:*"))

    done = run(app, "purge", "--pattern", "market:*", stdin="y\n")
    assert done.exit_code == 0, done.output
    assert "Purged 1 semaphore(s)." in done.output
    left = {k.decode() for k in redis_client.scan_iter(match=f"{prefix}:*")}
    assert left
    assert all("{report:1}" in k for k in left)


def test_purge_yes_json(app, busy, redis_client, prefix):
    result = run(app, "purge", "--yes", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["purged"] == 2
    assert not any(redis_client.scan_iter(match=f"{prefix}:*"))


def test_url_and_prefix_options_override_the_app(redis_url, busy, prefix):
    other = Celery("redsem-cli-other", broker="memory://", set_as_current=False)
    other.conf.redsem_redis_url = "redis://127.0.0.1:1/0"  # never used: --url wins
    try:
        result = run(other, "--url", redis_url, "--prefix", prefix, "status", "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["total"] == 2
    finally:
        reset(other)


def test_errors_are_one_line_not_a_traceback(redis_url, prefix):
    bad = Celery("redsem-cli-bad", broker="memory://", set_as_current=False)
    bad.conf.redsem_redis_url = "redis://127.0.0.1:1/0"
    bad.conf.redsem_redis_options = {"socket_connect_timeout": 0.5}
    try:
        result = run(bad, "status")
        assert result.exit_code == 1
        assert "Error: Redis failed" in result.output
        assert "Traceback" not in result.output
    finally:
        reset(bad)


def test_through_celerys_own_command_line(app, busy):
    from celery.bin.celery import celery

    result = CliRunner().invoke(
        celery, ["-A", "tests.test_cli:cli_app", "redsem", "status", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["total"] == 2


# -- names as names, and no stored id breaking a listing ------------------------------------------


def _keys(redis_client: redis.Redis, prefix: str) -> set[str]:
    return {k.decode() for k in redis_client.scan_iter(match=f"{prefix}:*")}


def _woken_waiter(redis_client: redis.Redis, prefix: str, name: str, waiter: str) -> str:
    """``name`` with ``waiter`` in line and woken by a release: its wake-up list exists."""
    sem = FairSemaphore(redis_client, name, 1, prefix=prefix, lease=30)
    first = sem.acquire(permit_id="first")
    sem.attempt(waiter, join_line=True)
    assert first is not None
    assert sem.release(first)
    wake = f"{prefix}:{{{name}}}:wake:{waiter}"
    assert redis_client.exists(wake), "the release did not wake the waiter"
    return wake


def test_a_waiter_id_that_looks_like_a_key_breaks_no_listing(app, busy, redis_client, prefix):
    wake = _woken_waiter(redis_client, prefix, "m", "evil}:holders")
    result = run(app, "status")
    assert result.exit_code == 0, result.output
    assert "m  limit 1  held 0/1  waiting 1" in result.output
    assert "waiter  #1  evil}:holders" in result.output
    assert "market:alice  limit 2" in result.output
    data = json.loads(run(app, "status", "--json").stdout)
    assert sorted(s["name"] for s in data["semaphores"]) == ["m", "market:alice", "report:1"]
    assert data["skipped"] == []

    refused = run(app, "purge", stdin="n\n")
    assert "3 semaphore(s)" in refused.output
    done = run(app, "purge", "m", "--yes")
    assert done.exit_code == 0, done.output
    assert "Purged 1 semaphore(s)." in done.output
    assert not [k for k in _keys(redis_client, prefix) if "{m}" in k]
    assert not redis_client.exists(wake)
    alice = FairSemaphore(redis_client, "market:alice", 2, prefix=prefix)
    assert [h.permit_id for h in alice.holders()] == ["task-a", "task-b"]


def test_a_glob_across_a_permit_ids_brace_purges_only_what_it_names(app, redis_client, prefix):
    # SCAN's "*" matches "a}:wake:x" in the wake-up list of "a"'s waiter "x}:y": "a" must stay.
    _woken_waiter(redis_client, prefix, "a", "x}:y")
    FairSemaphore(redis_client, "bx", 1, prefix=prefix, lease=30).acquire(permit_id="t")
    assert json.loads(run(app, "status", "-p", "*x", "--json").stdout)["total"] == 1
    done = run(app, "purge", "--pattern", "*x", "--yes", "--json")
    assert json.loads(done.stdout)["purged"] == 1
    left = _keys(redis_client, prefix)
    assert f"{prefix}:{{a}}:holders" in left
    assert not [k for k in left if "{bx}" in k]


def test_names_with_glob_characters_are_names(app, redis_client, prefix):
    for name in ("t:a", "t:b", "t:[ab]", "t:*", "t:?\\"):
        FairSemaphore(redis_client, name, 1, prefix=prefix, lease=30).acquire(permit_id="x")
    for name in ("t:[ab]", "t:*"):
        shown = json.loads(run(app, "status", name, "--json").stdout)
        assert [s["name"] for s in shown["semaphores"]] == [name]

    done = run(app, "purge", "t:[ab]", "--yes")
    assert done.exit_code == 0, done.output
    assert "Purged 1 semaphore(s)." in done.output
    left = _keys(redis_client, prefix)
    assert f"{prefix}:{{t:a}}:holders" in left
    assert f"{prefix}:{{t:b}}:holders" in left
    assert f"{prefix}:{{t:[ab]}}:holders" not in left
    assert run(app, "purge", "t:?\\", "--yes").exit_code == 0
    assert f"{prefix}:{{t:?\\}}:holders" not in _keys(redis_client, prefix)

    hint = run(app, "status", "t:[ab]")
    assert "NAME is a name, not a glob" in hint.output
    assert "--pattern 't:[ab]'" in hint.output
    by_glob = json.loads(run(app, "status", "--pattern", "t:[ab]", "--json").stdout)
    assert [s["name"] for s in by_glob["semaphores"]] == ["t:a", "t:b"]


def test_a_name_and_a_pattern_at_once_is_a_usage_error(app):
    result = run(app, "status", "x", "--pattern", "y*")
    assert result.exit_code == 2
    assert "not both" in result.output
    braces = run(app, "status", "--pattern", "x}*")
    assert braces.exit_code == 1
    assert "must not contain" in braces.output


def test_an_unreadable_semaphore_is_skipped_with_a_warning(app, busy, redis_client, prefix):
    redis_client.set(f"{prefix}:{{wrongtype}}:holders", "left by a bug")
    redis_client.hset(f"{prefix}:{{badbytes}}:holders", b"\xff\xfe", b"1:99999999999999")
    redis_client.hset(f"{prefix}:{{badbytes}}:holders", ":limit", 1)
    result = run(app, "status")
    assert result.exit_code == 0, result.output
    assert "market:alice  limit 2" in result.output
    assert "report:1  limit 1" in result.output
    assert "Warning: skipped semaphore wrongtype" in result.stderr
    assert "Warning: skipped semaphore badbytes" in result.stderr
    data = json.loads(run(app, "status", "--json").stdout)
    assert data["total"] == 4
    assert sorted(s["name"] for s in data["skipped"]) == ["badbytes", "wrongtype"]
    assert sorted(s["name"] for s in data["semaphores"]) == ["market:alice", "report:1"]

    done = run(app, "purge", "--yes", "--json")  # a poisoned semaphore can still be purged
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["purged"] == 4
    assert not _keys(redis_client, prefix)


def test_ids_with_control_characters_are_shown_escaped(app, redis_client, prefix):
    sem = FairSemaphore(redis_client, "esc", 1, prefix=prefix, lease=30)
    sem.acquire(permit_id="x\n  holder  forged  token 1")
    sem.attempt("\x1b[2Jcleared", join_line=True)
    result = run(app, "status", "esc")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 3
    assert not [line for line in lines if line.startswith("  holder  forged")]
    assert "\x1b" not in result.output
    assert "'x\\n  holder  forged  token 1'" in result.output


def test_an_operators_name_and_id_with_control_characters_are_shown_escaped(
    app, redis_client, prefix
):
    # inspect and release print NAME and PERMIT_ID as the operator typed them: an escape or a
    # carriage return in them must not reach the terminal (status escaped them already).
    name = "esc\x1b[31m\rname"
    sem = FairSemaphore(redis_client, name, 1, prefix=prefix, lease=30)
    held = sem.acquire(permit_id="p1")
    for args in (
        ("inspect", name),
        ("inspect", "missing\x1b[2J\r"),
        ("release", name, "p1"),
        ("release", name, "gone\x1b[2J\r"),
    ):
        result = run(app, *args)
        out = result.output + (result.stderr or "")
        assert "\x1b" not in out, args
        assert "\r" not in out, args
    assert held is not None


def test_status_lists_the_first_waiters_and_counts_the_rest(app, redis_client, prefix):
    # A hot key's line of 180 printed 180 lines; --max counts semaphores, not waiters.
    sem = FairSemaphore(redis_client, "hot", 1, prefix=prefix, lease=30)
    sem.acquire(permit_id="holder")
    for i in range(30):
        sem.attempt(f"w{i:02d}", join_line=True)
    lines = run(app, "status", "hot").output.splitlines()
    waiters = [line for line in lines if line.strip().startswith("waiter")]
    assert [w.split()[2] for w in waiters] == [f"w{i:02d}" for i in range(20)]
    assert lines[-1].strip() == "... and 10 more waiting (--waiters)"
    fewer = run(app, "status", "hot", "--waiters", "3").output.splitlines()
    assert sum(line.strip().startswith("waiter") for line in fewer) == 3
    data = json.loads(run(app, "status", "hot", "--json").stdout)
    assert len(data["semaphores"][0]["waiters"]) == 30  # JSON keeps them all
