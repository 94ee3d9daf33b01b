"""The seam over Celery's and kombu's private API: its probe, its slot queue, and a worker whose
internals are not as admission expects (admission off, one warning, guarded tasks still held
to their limit and done)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from celery import Celery
from kombu.asynchronous.semaphore import LaxBoundedSemaphore

from celery_redsem.integration import seam
from tests.integration.apps.renamed_slots import RenamedSlots
from tests.integration.conftest import running_workers


def _worker(semaphore: object, **attrs: object) -> SimpleNamespace:
    """What the probe reads of a prefork worker, with ``semaphore`` as its slots."""

    def hand_over(req: object) -> None: ...

    worker = SimpleNamespace(
        _process_task=hand_over,
        _process_task_sem=hand_over,
        process_task=hand_over,
        semaphore=semaphore,
        _quick_release=getattr(semaphore, "release", None),
    )
    vars(worker).update(attrs)
    return worker


def test_the_probe_passes_celerys_own_worker_layout() -> None:
    assert seam.probe(_worker(LaxBoundedSemaphore(2))) == []


def test_the_probe_names_what_it_does_not_find() -> None:
    assert "keeps no _waiting deque" in " ".join(seam.probe(_worker(RenamedSlots(2))))
    assert "no _process_task to hook" in " ".join(
        seam.probe(_worker(LaxBoundedSemaphore(2), _process_task=None))
    )
    assert "no _quick_release" in " ".join(
        seam.probe(_worker(LaxBoundedSemaphore(2), _quick_release=None))
    )


def test_the_probe_finds_a_slot_semaphore_that_hands_slots_on_unexpectedly() -> None:
    class Eager(LaxBoundedSemaphore):  # gives a released slot to nobody
        def release(self) -> None:
            self.value = min(self.value + 1, self.initial_value)

    assert "hands a released slot on unexpectedly" in " ".join(seam.probe(_worker(Eager(2))))


def test_the_versions_name_celery_and_kombu() -> None:
    assert seam.versions().startswith("celery 5.")
    assert ", kombu 5." in seam.versions()


def test_the_slot_queue_puts_first_removes_and_hands_slots_on() -> None:
    slots = LaxBoundedSemaphore(1)
    took: list[object] = []
    queue = seam.SlotQueue(slots, took.append)
    first, second, third = object(), object(), object()
    queue.take(first)  # a slot is free: taken now
    queue.take(second)
    queue.put_first(third)
    assert took == [first]
    assert list(queue.first(3)) == [third, second]
    assert queue.remove(third)
    assert not queue.remove(third)
    queue.give_back()  # the slot goes to the first queued
    assert took == [first, second]
    assert not queue


@pytest.mark.slow
def test_a_worker_whose_internals_changed_runs_without_admission_within_the_limit(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path,
        ["changed"],
        4,
        app_module="tests.integration.apps.changed_internals_app",
    ) as (worker,):
        results = [app.tasks["t.counted"].delay(key, 0.3) for _ in range(8)]
        assert all(r.get(timeout=90)["name"] == f"counted:{key}" for r in results)
        log = worker.log()
    assert log.count("worker admission is off") == 1, log
    assert "keeps no _waiting deque" in log
    assert "celery 5." in log
    assert "kombu 5." in log
    counter = redis.Redis.from_url(app.conf.broker_url)
    prefix = app.conf.redsem_key_prefix
    assert 1 <= int(counter.get(f"{prefix}:t:max:{key}") or 0) <= 3  # t.counted's limit
    assert int(counter.get(f"{prefix}:t:cur:{key}") or 0) == 0
    counter.close()
