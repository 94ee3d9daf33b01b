"""The end-to-end Celery benchmark: per-key limits through real prefork workers
(``python -m benchmarks.celery_e2e``, ``make bench-celery``)."""
