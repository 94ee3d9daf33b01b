"""The ``pools`` scenario: a one-key burst on the run's pool, run through, then stopped mid-way
by a ``SIGTERM`` and by a ``SIGKILL`` of its worker, with the ledger of every task.

Each phase: one fresh worker (``--pool``, ``--pool-concurrency``), warmed up; ``--backlog-tasks``
(1,000) x ``--backlog-duration`` (20 ms) on one key, limit ``--backlog-limit`` (2), sent at once.

* ``burst``: no stop; every task must run once.
* ``sigterm``: a ``SIGTERM`` (warm shutdown) once a third of the bodies have ended; Celery's
  default acknowledgement (as the task starts). Once the worker has exited, a fresh one
  finishes the line. Every task must run once.
* ``sigkill``: the task is ``acks_late``; a ``SIGKILL`` of the worker's process group once a
  third have ended, then a fresh worker. The bodies the kill cut run again (their messages
  were never acknowledged), and a body that ended up to 1 s before the kill may too (its ack
  may not have reached the broker): both are counted apart from true doubles.

On the Redis broker these phases run with a short ``visibility_timeout`` (:data:`VISIBILITY`,
so a dead worker's unacknowledged messages come back within the run) and kombu's sweep and
mutex shortened to match; on RabbitMQ a dead consumer's messages come back at once. After the
last task has run, the phase waits for anything still to come back (a redelivered copy) before
it stops the worker: on the Redis broker until :data:`VISIBILITY` plus 10 s after the stop.

The ledger (:mod:`benchmarks.celery_e2e.ledger`) counts what became of each task: ran once,
run again after a cut body, an ack in flight, ran twice, lost (never ran, no failure
recorded), failed. With ``--dump PATH`` each phase's records go to
``PATH.<broker>.<pool>.<phase>.ledger.json``; the workers' logs stay in ``--logs``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

from benchmarks._workers import stop_workers, wait_workers_ready
from benchmarks.celery_e2e.harness import (
    Bench,
    log_dir,
    pool_name,
    pool_slots,
    publish,
    run_name,
    start_workers,
    warm_up,
)
from benchmarks.celery_e2e.ledger import CATEGORIES, Ledger, build_ledger, is_defect
from benchmarks.celery_e2e.tables import Target, print_targets

VISIBILITY = 30  # seconds: the Redis broker's visibility_timeout in the stop phases
STOP_AT = 1 / 3  # the share of the bodies ended when the worker is stopped
QUIET = 3.0  # seconds waited after the last task ran, for a late copy
STALL = 30.0  # seconds without a body ending, once nothing more is due, before giving up


def broker_settings(bench: Bench) -> dict[str, Any]:
    """The Redis broker's transport options for the stop phases (none on RabbitMQ)."""
    if not bench.broker.is_redis:
        return {}
    options = {
        "global_keyprefix": f"{bench.prefix}:kombu:",
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        # a worker killed while it held kombu's lock on the unacknowledged messages keeps
        # every other worker from giving them back until the lock expires (300 s by default)
        "unacked_mutex_expire": 5,
    }
    return {"broker_transport_options": options}


def _records(bench: Bench, tag: str, what: str) -> list[dict[str, Any]]:
    raw = bench.client.lrange(f"{bench.prefix}:b:{tag}:{what}", 0, -1)
    return [json.loads(r) for r in raw]


def _done_ids(bench: Bench, tag: str) -> set[str]:
    return {r["id"] for r in _records(bench, tag, "done")}


def _signal(proc: subprocess.Popen[bytes], how: str) -> None:
    if how == "sigkill":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        print(f"  the worker did not exit within 120 s of the {how}: killed")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _wait_settled(bench: Bench, tag: str, ids: set[str], stop: float | None) -> None:
    """Wait until every task has run, then :data:`QUIET` more seconds (on the Redis broker, after
    a stop, until :data:`VISIBILITY` + 10 s after it), or until no body has ended for
    :data:`STALL` seconds once nothing more is due (``--timeout`` at most)."""
    due = 0.0 if stop is None or not bench.broker.is_redis else stop + VISIBILITY + 10
    deadline = time.time() + bench.args.timeout
    done_key = f"{bench.prefix}:b:{tag}:done"
    seen, progress, all_done = -1, time.time(), None
    while time.time() < deadline:
        now = time.time()
        count = int(bench.client.llen(done_key))
        if count != seen:
            seen, progress = count, now
        if all_done is None and count >= len(ids) and ids <= _done_ids(bench, tag):
            all_done = now
        if all_done is not None and now >= max(all_done + QUIET, due):
            return
        if all_done is None and now >= due and now - progress > STALL:
            print(f"  no body ended for {STALL:g} s: {len(ids - _done_ids(bench, tag))} not run")
            return
        time.sleep(0.2)
    print(f"  --timeout ({bench.args.timeout:g} s) reached")


def stop_phase(bench: Bench, how: str, n: int, seconds: float, limit: int) -> tuple[Ledger, int]:
    """One burst of ``n`` tasks on one key on a fresh worker, stopped mid-way ``how``
    (``burst``: not stopped; ``sigterm``, ``sigkill``); its ledger (printed) and the
    over-admissions the bodies counted."""
    tag, killed, acks_late = how, how == "sigkill", how == "sigkill"
    concurrency, logs = pool_slots(bench.args), log_dir(bench.args)
    settings = broker_settings(bench) if how != "burst" else {}
    shape = {"settings": settings}
    procs = start_workers(bench, tag, 1, concurrency, limit, logs, names=["victim"], **shape)
    stop: float | None = None
    try:
        wait_workers_ready(bench.app, 1)
        warm = bench.args.warmup
        warm_up(bench, tag, 4 * concurrency if warm is None else warm)
        mode = "fair_late" if acks_late else "fair"
        keys = [f"{tag}-hot"] * n
        sent = publish(bench, mode, tag, keys, seconds)
        ids = {f"{tag}.{i}" for i in range(n)}
        if how != "burst":
            deadline = time.monotonic() + bench.args.timeout
            while bench.client.llen(f"{bench.prefix}:b:{tag}:done") < n * STOP_AT:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{tag}: the burst did not get under way")
                time.sleep(0.01)
            stop = time.time()
            _signal(procs[0], how)
            exited = time.time()
            # the counter of the bodies under way: a cut body never counted itself out
            counter = f"{bench.prefix}:b:{tag}:cur:{tag}-hot"
            cut_count = int(bench.client.getset(counter, 0) or 0)
            print(
                f"  {how} at {stop - min(sent):.2f}s after the first send "
                f"({len(_done_ids(bench, tag))} of {n} ended); the worker exited "
                f"{exited - stop:.2f}s later with {cut_count} bodies under way"
            )
            procs += start_workers(
                bench, tag, 1, concurrency, limit, logs, names=["finisher"], **shape
            )
            wait_workers_ready(bench.app, 1)
        _wait_settled(bench, tag, ids, stop)
    finally:
        stop_workers(procs)
    starts, ends = _records(bench, tag, "started"), _records(bench, tag, "done")
    failed = [f["id"] for f in _failures(bench) if str(f["id"]).startswith(f"{tag}.")]
    ledger = build_ledger(
        ids, starts, ends, stop, killed=killed, acks_late=acks_late, failed=failed
    )
    over = int(bench.client.get(f"{bench.prefix}:b:{tag}:over") or 0)
    retries = sum(r["retries"] for r in ends)
    makespan = max(r["end"] for r in ends) - min(sent) if ends else float("nan")
    if bench.args.dump:
        path = f"{bench.args.dump}.{run_name(bench)}.{tag}.ledger.json"
        with open(path, "w") as f:
            dump = {"sent": sent, "stop": stop, "starts": starts, "ends": ends, "failed": failed}
            json.dump({**dump, "categories": ledger.categories}, f)
    _print_ledger(how, ledger, over, retries / max(1, len(ends)), makespan)
    return ledger, over


def _failures(bench: Bench) -> list[dict[str, Any]]:
    return [json.loads(r) for r in bench.client.lrange(f"{bench.prefix}:b:failed", 0, -1)]


def _print_ledger(how: str, ledger: Ledger, over: int, repub: float, makespan: float) -> None:
    counts = ledger.counts
    print(
        f"  {how:<8} makespan {makespan:.2f}s, re-pub/task {repub:.3f}, most at once "
        f"{ledger.most_at_once}, over-admissions {over}, copies at once {len(ledger.overlapping)}"
    )
    print("  ledger: " + ledger.line())
    flags = {"killed": ledger.killed, "acks_late": ledger.acks_late}
    for category in CATEGORIES:
        if counts[category] and (category != "once"):
            kind = "DEFECT" if is_defect(category, **flags) else "expected"
            shown = ", ".join(ledger.ids(category)[:8])
            more = f" (+{counts[category] - 8})" if counts[category] > 8 else ""
            print(f"    {category} ({kind}): {shown}{more}")
    if ledger.ack_gaps:
        gaps = ", ".join(f"{g * 1000:.0f}" for g in ledger.ack_gaps[:12])
        print(f"    ack in flight: the first body ended this many ms before the kill: {gaps}")
    if ledger.overlapping:
        print(f"    copies at once: {', '.join(ledger.overlapping[:8])}")


def pools(bench: Bench) -> bool:
    """The burst run through, stopped by SIGTERM and by SIGKILL, each with its ledger."""
    a = bench.args
    n = max(1, round(a.backlog_tasks * a.scale))
    d, limit = a.backlog_duration, a.backlog_limit
    pool, concurrency = pool_name(a), pool_slots(a)
    visibility = f"visibility_timeout {VISIBILITY} s" if bench.broker.is_redis else "RabbitMQ"
    print(
        f"{n} tasks x {d * 1000:g} ms on one key, limit {limit}, one worker -P {pool} "
        f"-c {concurrency}, prefetch {a.prefetch}; stopped once {STOP_AT:.0%} ended, a fresh "
        f"worker finishes; SIGKILL with acks_late ({visibility})"
    )
    targets = []
    for how in ("burst", "sigterm", "sigkill"):
        ledger, over = stop_phase(bench, how, n, d, limit)
        targets.append(Target(f"{how}: lost or run twice (defects)", ledger.defects, 0, True, 0))
        targets.append(Target(f"{how}: most bodies at once", ledger.most_at_once, limit, True, 0))
        targets.append(Target(f"{how}: over-admissions", over, 0, True, 0))
    return print_targets(targets)
