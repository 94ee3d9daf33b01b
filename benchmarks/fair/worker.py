"""What a fair-share benchmark worker loads (``celery -A benchmarks.fair.worker worker``): its
app, built from the environment the benchmark set (:func:`~benchmarks.fair.app.worker_app`).
Nothing else imports this module."""

from __future__ import annotations

from benchmarks.fair.app import worker_app

app = worker_app()
