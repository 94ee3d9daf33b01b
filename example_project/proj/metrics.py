"""The worker's Prometheus metrics (``celery_redsem[metrics]``), off unless asked for.

``REDSEM_METRICS_PORT=9808 celery -A proj worker`` serves them at
``http://localhost:9808/metrics``. With the prefork pool (the default) the tasks run in child
processes: also set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before the worker starts,
and ``/metrics`` shows the sum over the main process and every child (see the metrics page).
"""

from __future__ import annotations

import os
from typing import Any

from celery.signals import worker_init, worker_process_shutdown

#: The environment variable that turns the metrics on: the port to serve them on.
PORT_VARIABLE = "REDSEM_METRICS_PORT"


@worker_init.connect
def start_metrics(**_: Any) -> None:
    """In the worker's main process, before the pool starts its children (they inherit it)."""
    port = os.environ.get(PORT_VARIABLE)
    if port:
        from celery_redsem.metrics import enable_metrics, serve_metrics

        enable_metrics()
        serve_metrics(int(port))


@worker_process_shutdown.connect
def forget_child(pid: int, **_: Any) -> None:
    """A pool child is leaving: its live gauge values go with it (multiprocess mode)."""
    if os.environ.get(PORT_VARIABLE) and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
