"""Where a FairSemaphore pair's time goes, when it misses a floor target (or on
``--breakdown always``): wall, server and client-CPU time per pair for a ladder of variants."""

from __future__ import annotations

import statistics
from typing import Any

import redis

from benchmarks.core.contenders import Contender, Floor, HeldFloor, Redsem, TryOnly
from benchmarks.core.idle import IDLE_LIMIT, interleave, pairs_per_second
from benchmarks.core.table import print_table
from celery_redsem import FairSemaphore, Permit


class _Recording(redis.Redis):
    """A client that remembers every command it sends and the reply (to replay them)."""

    sent: list[tuple[Any, Any]]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        self.sent.append((args, reply))
        return reply


class SameShape(TryOnly):
    """FairSemaphore's recorded commands with trivial scripts: the cost of its arguments.

    Each script is swapped for one that at once returns a reply of the same shape (a grant,
    which comes as a status line, as the same status line).
    """

    def __init__(self, url: str, prefix: str, limit: int) -> None:
        recorder = _Recording(connection_pool=redis.ConnectionPool.from_url(url))
        recorder.sent = []
        sem = FairSemaphore(recorder, "shape", limit, prefix=prefix)
        sem.release(_granted(sem.acquire()))  # load the scripts
        recorder.sent.clear()
        sem.release(_granted(sem.acquire()))
        # Replayed over one kept connection, as FairSemaphore sends them (lane.py).
        self.client = redis.Redis.from_url(url, single_connection_client=True)
        self.calls: list[tuple[Any, ...]] = []
        for args, reply in recorder.sent:
            if str(args[0]).upper() != "EVALSHA":
                raise RuntimeError(f"FairSemaphore sent {args[0]!r} on an idle semaphore")
            if isinstance(reply, list):
                shape = "{" + ", ".join("1" for _ in reply) + "}"
            elif isinstance(reply, bytes):  # a grant: '<token>:<expiry>'
                shape = "{ok = '" + reply.decode() + "'}"
            else:
                shape = "1"
            sha = str(self.client.script_load(f"return {shape}"))
            self.calls.append(("EVALSHA", sha, *args[2:]))
        recorder.close()

    def try_acquire(self) -> object | None:
        for call in self.calls:
            self.client.execute_command(*call)  # type: ignore[no-untyped-call]
        return True

    def release(self, handle: Any) -> None:
        """Nothing: :meth:`try_acquire` already replayed the release too."""


def _granted(permit: Permit | None) -> Permit:
    if permit is None:
        raise RuntimeError("FairSemaphore refused a permit on an idle semaphore")
    return permit


SCRIPT_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


def _script_usec(client: redis.Redis) -> tuple[int, int]:
    """Calls and server microseconds of script commands so far (scripts' inner calls excluded)."""
    stats = client.info("commandstats")
    calls = usec = 0
    for name in SCRIPT_COMMANDS:
        entry = stats.get(f"cmdstat_{name}", {})
        calls += int(entry.get("calls", 0))
        usec += int(entry.get("usec", 0))
    return calls, usec


def run_breakdown(client: redis.Redis, url: str, prefix: str, rounds: int, slice_s: float) -> None:
    """Print wall, server and client-CPU microseconds per pair for a ladder of variants."""
    shape = SameShape(url, prefix, IDLE_LIMIT)
    ladder: list[tuple[str, Contender, int]] = [
        ("floor: 2x EVALSHA 'return 1', no arguments", Floor(client, prefix, IDLE_LIMIT), 2),
        ("  same, on a kept connection", HeldFloor(client, prefix, IDLE_LIMIT), 2),
        (
            f"FairSemaphore's {len(shape.calls)} calls & arguments, trivial scripts, kept conn.",
            shape,
            len(shape.calls),
        ),
        ("FairSemaphore.acquire + release", Redsem(client, prefix, IDLE_LIMIT), len(shape.calls)),
    ]
    timed = interleave({label: impl for label, impl, _ in ladder}, rounds, slice_s)
    server: dict[str, float] = {}
    for label, impl, calls_per_pair in ladder:  # server time: one slice each, not interleaved
        calls0, usec0 = _script_usec(client)
        pairs_per_second(impl, slice_s)
        calls1, usec1 = _script_usec(client)
        server[label] = (usec1 - usec0) / max(1.0, (calls1 - calls0) / calls_per_pair)
    shape.client.close()
    print()
    print("Where a FairSemaphore pair's time goes (median microseconds per acquire+release pair):")
    rows = [["variant", "wall us", "server us", "client CPU us"]]
    rows += [
        [
            label,
            f"{statistics.median(timed.wall[label]) * 1e6:.1f}",
            f"{server[label]:.1f}",
            f"{statistics.median(timed.cpu[label]) * 1e6:.1f}",
        ]
        for label, _, _ in ladder
    ]
    print_table(rows)
    print(
        "  server us = EVALSHA time inside the server (INFO commandstats; on a shared server\n"
        "  other clients' EVALSHA count too); client CPU us = this process's CPU time, send/recv\n"
        "  syscalls included. Wall minus both: waiting for the server process to be scheduled,\n"
        "  and the loopback hop."
    )
