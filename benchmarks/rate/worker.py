"""What a rate benchmark worker loads (``celery -A benchmarks.rate.worker worker``): its app,
built from the environment the benchmark set (:func:`~benchmarks.rate.app.worker_app`). Nothing
else imports this module."""

from __future__ import annotations

from benchmarks.rate.app import worker_app

app = worker_app()
