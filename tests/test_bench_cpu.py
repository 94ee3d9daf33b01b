"""The benchmarks' CPU meter: readings of real processes, and the per-task arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from benchmarks.cpu import (
    CpuMeter,
    CpuReading,
    compare_line,
    cpu_seconds,
    local_redis_pid,
    median_reading,
    per_task,
)
from tests.servers import wait_until

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")

# A parent that starts a child which burns CPU until it reads a line on stdin (its parent's),
# then exits; the parent itself only waits.
_SPIN = "import select, sys\\nwhile not select.select([sys.stdin], [], [], 0)[0]: pass"
_PARENT = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "{_SPIN}"], stdin=sys.stdin)
print("started", flush=True)
child.wait()
"""


@pytest.fixture
def busy_family() -> Iterator[subprocess.Popen[str]]:
    """A process whose one child spins on a CPU until a line comes on stdin."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "started\n"
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.write("stop\n")
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_a_workers_child_counts_under_children(busy_family: subprocess.Popen[str]) -> None:
    meter = CpuMeter([busy_family.pid], [])
    wait_until(lambda: (r := meter.read()) is not None and r.children > 0, 10, what="child CPU")
    first = meter.read()
    assert first is not None
    wait_until(
        lambda: (r := meter.read()) is not None and r.children >= first.children + 0.2,
        10,
        what="0.2 s more of the child's CPU",
    )
    last = meter.read()
    assert last is not None
    spent = last - first
    assert spent.main < 0.1  # the parent only waits
    assert spent.redis == 0.0  # no server given


def test_a_local_redis_server_is_found_and_metered(redis_url: str) -> None:
    pid = local_redis_pid(redis_url)
    if pid is None:
        pytest.skip("the test server does not run on this host")
    assert cpu_seconds(pid) is not None
    meter = CpuMeter([os.getpid()], [pid, pid, None])  # (one server, named twice)
    assert meter.read() is not None


def test_a_remote_or_missing_server_has_no_pid() -> None:
    assert local_redis_pid("redis://redis.example.invalid:6379/0") is None
    assert cpu_seconds(2**22 + 12345) is None  # above the kernel's pid_max default


def test_per_task_is_milliseconds_per_task_by_kind() -> None:
    before, after = CpuReading(1.0, 2.0, 0.5), CpuReading(1.5, 3.0, 0.6)
    spent = per_task(before, after, 500)
    assert spent is not None
    assert (spent.main, spent.children, spent.redis) == pytest.approx((1.0, 2.0, 0.2))
    assert per_task(None, after, 500) is None
    assert per_task(before, after, 0) is None


def test_compare_line_gives_medians_and_the_difference() -> None:
    guarded = [CpuReading(3.0, 2.0, 0.5), CpuReading(2.5, 1.5, 0.4), CpuReading(9.0, 9.0, 9.0)]
    plain = [CpuReading(2.0, 1.0, 0.3), CpuReading(2.2, 1.2, 0.3), CpuReading(0.0, 0.0, 0.0)]
    assert median_reading(guarded) == CpuReading(3.0, 2.0, 0.5)
    line = compare_line(guarded, plain)
    assert line is not None
    assert "guarded main 3.00, children 2.00, Redis 0.50 (all 5.50)" in line
    assert "plain main 2.00, children 1.00, Redis 0.30 (all 3.30)" in line
    assert "guarded - plain main +1.00, children +1.00, Redis +0.20 (all +2.20)" in line
    assert compare_line([*guarded, None], plain) is None
    assert median_reading([]) is None
