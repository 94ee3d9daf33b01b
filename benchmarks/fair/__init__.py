"""The fair-share benchmark: accounts sharing one limit, fair share against FIFO
(``python -m benchmarks.fair``, ``make bench-fair``)."""
