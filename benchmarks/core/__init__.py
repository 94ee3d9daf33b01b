"""The core benchmark: acquire + release on an idle semaphore, and contention
(``python -m benchmarks.core``, ``make bench-core``)."""
