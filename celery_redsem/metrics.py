"""Prometheus metrics of this worker process (the ``celery_redsem[metrics]`` extra).

Off until :func:`enable_metrics` is called: until then the ``record_*`` functions do nothing
and ``prometheus_client`` is not imported. Every metric is labelled by task name only (never
by semaphore name: one per account would be one time series per account):

* ``redsem_grants_total``: permits granted to task runs (in a pool child, in the main process
  at admission, or to an eager call). In a task with more than one guard, another guard may
  send the run back to wait (a retry) after the grant, which it then gives back: there a
  grant counts when the run ends other than by a retry, so each run counts once;
* ``redsem_waits_total{how}``: rounds of waiting for a permit, by how: ``retry`` (the run
  re-published with a countdown) or ``park`` (a spell parked in the main process, admission).
  A run that waits long waits several rounds;
* ``redsem_skips_total``: runs skipped because their semaphore was busy
  (:func:`record_skip`);
* ``redsem_coalesced_total{how}``: sends absorbed by the pending run of their key
  (``dedupe="coalesce"``), by how: ``coalesced`` or ``debounced`` (the task has ``debounce=``),
  counted where they were absorbed (a sending process that turned metrics on, or a worker's
  main process for a message that came another way);
* ``redsem_timeouts_total``: runs that failed with :class:`~celery_redsem.AcquireTimeout`;
* ``redsem_lost_leases_total``: permits that lost their lease while their task ran;
* ``redsem_wait_seconds``: histogram of the wait from a run's first ask to its grant, across
  contention retries and parking (0 when granted at once);
* ``redsem_parked_tasks``: tasks parked by admission now (no task label).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

from celery import states
from celery.signals import task_postrun

from celery_redsem.core.lease_events import (
    LostPermit,
    add_loss_listener,
    remove_loss_listener,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "WAIT_BUCKETS",
    "Metrics",
    "disable_metrics",
    "enable_metrics",
    "metrics_on",
    "record_coalesced",
    "record_grant",
    "record_grant_at_end",
    "record_park",
    "record_skip",
    "record_timeout",
    "record_unpark",
    "record_wait",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

#: Bucket bounds (seconds) of ``redsem_wait_seconds``: from an uncontended grant to an hour.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)
_NAMESPACE = "redsem"  # every metric's name starts with it


class Metrics(NamedTuple):
    """The metric objects, in the registry given to :func:`enable_metrics`."""

    grants: Counter
    waits: Counter
    skips: Counter
    timeouts: Counter
    lost_leases: Counter
    wait_seconds: Histogram
    parked: Gauge
    coalesced: Counter


#: Where a run keeps its grants until it ends (see record_grant_at_end), on its request.
_PENDING = "_redsem_pending_grants"
_POSTRUN_UID = f"{__name__}.count_pending_grants"

_lock = threading.Lock()
_metrics: Metrics | None = None
_registry: Any = None


def enable_metrics(registry: CollectorRegistry | None = None) -> Metrics:
    """Turn the metrics on in this process, registered in ``registry`` (default:
    ``prometheus_client.REGISTRY``); call it once, at ``worker_init``, before the pool forks.

    Calling it again with the same registry returns the same metrics; with another one, they
    move there (counts start again from 0).
    """
    global _metrics, _registry
    import prometheus_client as prom

    target = prom.REGISTRY if registry is None else registry
    with _lock:
        if _metrics is not None and _registry is target:
            return _metrics
        _unregister()
        task = ("task",)
        ns = _NAMESPACE  # registry=None: each is registered below, in target
        metrics = Metrics(
            grants=prom.Counter(
                "grants", "Permits granted to task runs.", task, namespace=ns, registry=None
            ),
            waits=prom.Counter(
                "waits",
                "Rounds of waiting for a permit, by how: a retry or a spell parked.",
                ("task", "how"),
                namespace=ns,
                registry=None,
            ),
            skips=prom.Counter(
                "skips", "Runs skipped: semaphore busy.", task, namespace=ns, registry=None
            ),
            timeouts=prom.Counter(
                "timeouts", "Runs failed with AcquireTimeout.", task, namespace=ns, registry=None
            ),
            lost_leases=prom.Counter(
                "lost_leases",
                "Permits that lost their lease while running.",
                task,
                namespace=ns,
                registry=None,
            ),
            wait_seconds=prom.Histogram(
                "wait_seconds",
                "Seconds from a task run's first ask for a permit to its grant.",
                task,
                namespace=ns,
                registry=None,
                buckets=WAIT_BUCKETS,
            ),
            parked=prom.Gauge(
                "parked_tasks",
                "Tasks parked by admission in the worker's main process now.",
                namespace=ns,
                registry=None,
                multiprocess_mode="livesum",
            ),
            coalesced=prom.Counter(
                "coalesced",
                "Sends absorbed by the pending run of their key, by how.",
                ("task", "how"),
                namespace=ns,
                registry=None,
            ),
        )
        for metric in metrics:
            target.register(metric)
        _metrics, _registry = metrics, target
    add_loss_listener(_on_loss)
    task_postrun.connect(_on_postrun, weak=False, dispatch_uid=_POSTRUN_UID)
    return metrics


def _unregister() -> None:
    global _metrics, _registry
    if _metrics is not None:
        for metric in _metrics:
            _registry.unregister(metric)
    _metrics, _registry = None, None


def disable_metrics() -> None:
    """Turn the metrics off and take them out of their registry."""
    remove_loss_listener(_on_loss)
    task_postrun.disconnect(_on_postrun, dispatch_uid=_POSTRUN_UID)
    with _lock:
        _unregister()


def serve_metrics(port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 (for a scraper)
    """Serve this process's metrics over HTTP for Prometheus to scrape; under prefork with
    ``PROMETHEUS_MULTIPROC_DIR`` set, the sum over the main process and every pool child.

    A port that cannot be served on (another process has it) raises :class:`OSError`, and is
    also logged as an error first: Celery's signal dispatch catches what a ``worker_init``
    receiver raises, and the example project's worker printed nothing of it and ran on
    without its metrics.
    """
    import prometheus_client as prom
    from prometheus_client import multiprocess

    registry = prom.REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = prom.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    try:
        prom.start_http_server(port, addr, registry=registry)
    except OSError as exc:
        logger.error(
            "celery_redsem: cannot serve metrics on %s:%s (%s); this process serves none",
            addr,
            port,
            exc,
        )
        raise


# -- the calls the rest of the package makes (each does nothing while metrics are off) -------


def metrics_on() -> bool:
    """Whether the metrics are on in this process (callers skip work that only feeds them)."""
    return _metrics is not None


def record_grant(task_name: str, waited: float) -> None:
    """A run of ``task_name`` got its permit after waiting ``waited`` seconds."""
    metrics = _metrics
    if metrics is not None:
        metrics.grants.labels(task_name).inc()
        metrics.wait_seconds.labels(task_name).observe(max(0.0, waited))


def record_grant_at_end(request: Any, task_name: str, waited: float) -> None:
    """A run of ``task_name`` with more than one guard got a permit after ``waited`` seconds:
    another guard may still send it back (a retry) before its body starts, so the grant counts
    once the run ends, unless it ends so. (Each run counts once.)"""
    if _metrics is None:
        return
    pending = getattr(request, _PENDING, None) or ()
    setattr(request, _PENDING, (*pending, (task_name, waited)))


def record_wait(task_name: str, how: str) -> None:
    """A run of ``task_name`` waits for its permit: ``how`` is ``"retry"`` or ``"park"``."""
    metrics = _metrics
    if metrics is not None:
        metrics.waits.labels(task_name, how).inc()


def record_park(task_name: str | None) -> None:
    """Admission parked a request of ``task_name`` (a wait, and one more parked task)."""
    metrics = _metrics
    if metrics is not None:
        metrics.waits.labels(task_name or "?", "park").inc()
        metrics.parked.inc()


def record_unpark(parked: object | None) -> None:
    """A parked task (``parked``, if not None) left the parking: resumed or dropped."""
    metrics = _metrics
    if metrics is not None and parked is not None:
        metrics.parked.dec()


def record_skip(task_name: str) -> None:
    """A run of ``task_name`` was skipped because its semaphore was busy."""
    metrics = _metrics
    if metrics is not None:
        metrics.skips.labels(task_name).inc()


def record_coalesced(task_name: str, how: str) -> None:
    """A send of ``task_name`` was absorbed by a pending run (``how``: coalesced, debounced)."""
    metrics = _metrics
    if metrics is not None:
        metrics.coalesced.labels(task_name, how).inc()


def record_timeout(task_name: str) -> None:
    """A run of ``task_name`` failed with :class:`~celery_redsem.AcquireTimeout`."""
    metrics = _metrics
    if metrics is not None:
        metrics.timeouts.labels(task_name).inc()


def _on_postrun(task: Any = None, state: str | None = None, **_: Any) -> None:
    """A run ended: count the grants it kept pending, unless it was sent back (a retry)."""
    request = getattr(task, "request", None)
    pending = getattr(request, _PENDING, None)
    if not pending:
        return
    setattr(request, _PENDING, ())
    if state != states.RETRY:
        for task_name, waited in pending:
            record_grant(task_name, waited)


def _on_loss(held: LostPermit) -> None:
    metrics = _metrics
    if metrics is not None:
        metrics.lost_leases.labels(held.task_name or "?").inc()
