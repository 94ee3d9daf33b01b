"""What a benchmark worker loads (``celery -A benchmarks.celery_e2e.worker worker``): its app,
built from the environment the harness set (:func:`~benchmarks.celery_e2e.app.worker_app`).
Nothing else imports this module."""

from __future__ import annotations

from benchmarks.celery_e2e.app import worker_app

app = worker_app()
