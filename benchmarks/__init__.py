"""Benchmarks for celery_redsem (not part of the test suite), one subpackage each.

* :mod:`benchmarks.core` (``python -m benchmarks.core``, ``make bench-core``): the core
  semaphore against a round-trip floor, redis-py's ``Lock`` and re-implementations of the
  "Redis in Action" semaphores.
* :mod:`benchmarks.celery_e2e` (``python -m benchmarks.celery_e2e``, ``make bench-celery``):
  per-key limits through real prefork workers.
* :mod:`benchmarks.rate` (``python -m benchmarks.rate``, ``make bench-rate``): per-key rate
  limits against Celery's ``rate_limit``.
"""
