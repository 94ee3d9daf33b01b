"""The per-key rate benchmark: ``@with_rate_limit`` against Celery's ``rate_limit``
(``python -m benchmarks.rate``, ``make bench-rate``)."""
