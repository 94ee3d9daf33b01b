"""Benchmarks for celery_redsem (not part of the test suite).

``python -m benchmarks.bench_core`` (``make bench-core``) compares the core semaphore with a
round-trip floor, redis-py's ``Lock`` and re-implementations of the "Redis in Action" semaphores.
"""
