# One command per job: `make test` and `make demo` set themselves up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-oldest lint types pytest docs demo bench bench-core bench-celery bench-burst bench-pools bench-rate bench-fair clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev,docs,demo,metrics]'
	touch $(STAMP)

test: lint types pytest docs

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

types: $(STAMP)
	$(VENV)/bin/mypy celery_redsem benchmarks

pytest: $(STAMP)
	$(PY) -m pytest -n 3 --dist loadfile

# The fast suite on the oldest declared Celery, kombu, redis-py and Python, in .venv-oldest.
test-oldest:
	bash .ci/test-oldest

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

demo: $(STAMP)
	$(PY) -m example_project.demo

bench: bench-core

bench-core: $(STAMP)
	$(PY) -m benchmarks.core

# Every scenario on both brokers (RabbitMQ skipped where none answers on 127.0.0.1:5672);
# e.g. `make bench-celery BENCH_ARGS="--scale 0.1"` for a smoke run. Classic run alone:
# `python -m benchmarks.celery_e2e`; see its --help.
BENCH_ARGS ?=
bench-celery: $(STAMP)
	$(PY) -m benchmarks.celery_e2e --scenario all $(BENCH_ARGS)

# One hot key's 1,000-deep burst (issue 19's backlog scenario) on both brokers.
bench-burst: $(STAMP)
	$(PY) -m benchmarks.celery_e2e --scenario backlog $(BENCH_ARGS)

# Issue 38: backlog, uncontended, mixed and the stop ledger (SIGTERM, SIGKILL mid-burst) on
# threads -c 20, gevent -c 100 and eventlet -c 100, then hot-mixed on gevent -c 200; both
# brokers (RabbitMQ skipped with a printed line where none answers on 127.0.0.1:5672).
bench-pools: $(STAMP)
	$(PY) -m benchmarks.celery_e2e --pool threads,gevent,eventlet \
		--scenario backlog,uncontended,mixed,pools $(BENCH_ARGS)
	$(PY) -m benchmarks.celery_e2e --pool gevent --scenario hot-mixed $(BENCH_ARGS)

# Per-key rate: @with_rate_limit against Celery's rate_limit, two workers, both brokers.
bench-rate: $(STAMP)
	$(PY) -m benchmarks.rate $(BENCH_ARGS)

# Issue 40: accounts a, b, c send 300/300/30 tasks at a shared limit of 4; fair share (weights
# 1:1:1, 2:1:1, a group limit) against FIFO; two workers, both brokers.
bench-fair: $(STAMP)
	$(PY) -m benchmarks.fair $(BENCH_ARGS)

clean:
	rm -rf $(VENV) docs/_build .pytest_cache .mypy_cache .ruff_cache
