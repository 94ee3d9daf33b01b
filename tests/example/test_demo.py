"""The parts of ``make demo`` that a failure would hide: cleaning up processes, the chart."""

from __future__ import annotations

import os
import signal
import subprocess

from example_project import demo

# A parent that ignores SIGTERM and a grandchild: both must be gone after the stop.
STUBBORN = "trap '' TERM; sleep 60 & echo started; sleep 60"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stopping_the_worker_leaves_no_process_of_its_group():
    proc = subprocess.Popen(["sh", "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"started\n"
    proc.stdout.close()
    demo.stop_process_group(proc, signal.SIGTERM, grace=0.5)
    assert proc.returncode == -signal.SIGKILL
    assert not group_alive(proc.pid)


def test_the_timeline_chart_is_written(tmp_path):
    events = [(100.0, "alice", 1), (100.5, "alice", 2), (101.0, "bob", 1), (102.0, "alice", 0)]
    path = demo.write_chart(events, 100.0, tmp_path / "timeline.png")
    assert path.read_bytes().startswith(b"\x89PNG")
