"""What a sender process runs in tests/integration/test_coalesce.py: it imports only the tasks
module, runs the scenario named by its first argument, and prints one JSON line."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from celery import chain
from celery.result import AsyncResult
from prometheus_client import CollectorRegistry

from celery_redsem.core.marks import CoalesceRecord
from celery_redsem.metrics import enable_metrics
from celery_redsem.signals import task_coalesced
from tests.integration.apps.coalesce_tasks import (
    PREFIX,
    app,
    bodies,
    capped,
    counter,
    debounced,
    echo,
    rebuild,
    rebuild_late,
)

#: What this process's task_coalesced signals said, and its metrics.
signals: list[dict[str, Any]] = []
registry = CollectorRegistry()

TIMEOUT = float(os.environ.get("REDSEM_TEST_SENDER_TIMEOUT", "60"))


def until(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.02)
    raise TimeoutError(what)


def outcome(result: AsyncResult) -> object:
    try:
        return result.get(timeout=TIMEOUT)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def pending_of(name: str) -> str | None:
    return CoalesceRecord(counter(), name, prefix=PREFIX).state().pending


def server_time() -> float:
    seconds, micros = counter().time()
    return float(seconds + micros / 1e6)


def five_during_a_run(doc: str, last: str = "v5") -> dict[str, Any]:
    first = rebuild.delay(doc, "v0", hold=True)
    until(lambda: bodies(doc), "the first body")
    versions = [f"v{i}" for i in range(1, 5)] + [last]
    sends = [rebuild.delay(doc, version) for version in versions]
    counter().rpush(f"{PREFIX}:c:go:{doc}", 1)
    return {
        "ids": [first.id] + [r.id for r in sends],
        "results": [outcome(r) for r in [first, *sends]],
    }


def debounce(doc: str) -> dict[str, Any]:
    sends, last_sent = [], 0.0
    for i in range(5):
        if i:
            time.sleep(0.1)  # (the scenario: sends 0.1 s apart)
        last_sent = server_time()
        sends.append(debounced.delay(doc, f"v{i}"))
    return {"last_sent": last_sent, "results": [outcome(r) for r in sends]}


def debounce_max(doc: str) -> dict[str, Any]:
    first_sent, sends = server_time(), []
    for i in range(30):  # 3 s of sends 0.1 s apart: never quiet for debounce=0.3
        sends.append(capped.delay(doc, f"v{i}"))
        time.sleep(0.1)
    return {"first_sent": first_sent, "results": [outcome(r) for r in sends]}


def other_ways(doc: str) -> dict[str, Any]:
    name = f"rebuild:{doc}"
    first = rebuild.delay(doc, "v0", hold=True)
    until(lambda: bodies(doc), "the first body")
    by_name = app.send_task("c.rebuild", (doc, "v1"))
    until(lambda: pending_of(name) == by_name.id, "send_task's message pending")
    steps = chain(rebuild.si(doc, "v2"), echo.si("after")).apply_async()
    step = steps.parent
    assert step is not None
    until(lambda: pending_of(name) == step.id, "the canvas step pending")
    later = rebuild.delay(doc, "v3")
    another = app.send_task("c.rebuild", (doc, "v4"))
    until(lambda: counter().hexists(f"{PREFIX}:{{{name}}}:dedupe", f"a:{another.id}"), "absorbed")
    counter().rpush(f"{PREFIX}:c:go:{doc}", 1)
    results = [outcome(r) for r in (first, by_name, step, steps, later, another)]
    return {"results": results, "later_id": later.id, "step_id": step.id}


def killed(doc: str) -> dict[str, Any]:
    first = rebuild.delay(doc, "v0", hold=True)
    body = until(lambda: bodies(doc), "the first body")[0]
    sends = [rebuild.delay(doc, f"v{i}") for i in range(1, 4)]
    os.kill(int(body["pid"]), signal.SIGKILL)  # the pool child running the body
    return {"results": [outcome(r) for r in [first, *sends]]}


def before_the_kill(doc: str) -> dict[str, Any]:
    first = rebuild_late.delay(doc, "v0", hold=True)
    until(lambda: bodies(doc), "the first body")
    sends = [rebuild_late.delay(doc, f"v{i}") for i in range(1, 4)]
    return {"ids": [first.id] + [r.id for r in sends]}


def after_the_kill(doc: str, *ids: str) -> dict[str, Any]:
    counter().rpush(f"{PREFIX}:c:go:{doc}", 1, 1)  # the first run's body runs again
    return {"results": [outcome(AsyncResult(i, app=app)) for i in ids]}


def too_large(doc: str) -> dict[str, Any]:
    try:
        rebuild.delay(doc, "x" * 70_000)
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    by_name = app.send_task("c.rebuild", (doc, "y" * 70_000))
    return {"raised": raised, "by_name": outcome(by_name)}


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f
    for f in (
        five_during_a_run,
        debounce,
        debounce_max,
        other_ways,
        killed,
        before_the_kill,
        after_the_kill,
        too_large,
    )
}


def _note(sender: Any = None, **kwargs: Any) -> None:
    signals.append({"task": sender.name, **{k: v for k, v in kwargs.items() if k != "signal"}})


def _counted(task: str) -> dict[str, float]:
    found = {}
    for how in ("coalesced", "debounced"):
        labels = {"task": task, "how": how}
        found[how] = registry.get_sample_value("redsem_coalesced_total", labels) or 0.0
    return found


if __name__ == "__main__":
    scenario, doc, *rest = sys.argv[1:]
    enable_metrics(registry)
    task_coalesced.connect(_note, weak=False)
    found = SCENARIOS[scenario](doc, *rest)
    counted = {name: _counted(name) for name in ("c.rebuild", "c.debounced")}
    report = {**found, "signals": signals, "counted": counted, "finalized": app.finalized}
    print(json.dumps(report))
