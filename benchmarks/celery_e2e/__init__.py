"""End-to-end Celery benchmark: per-key limits through real workers of every pool.

Run with ``make bench-celery`` (every scenario, both brokers) or ``python -m
benchmarks.celery_e2e [--scenario NAME[,NAME]] [--brokers redis,amqp] [--scale F]``. One
server (see :mod:`benchmarks._server`) holds results, semaphores and the bodies' records; it is
also the ``redis`` broker. ``amqp`` is RabbitMQ (see :mod:`benchmarks._brokers`), skipped with
a printed line where nothing answers. Each scenario on each broker runs under a unique prefix
(its keys, its queue, its control exchange) that is deleted afterwards, and starts fresh
workers for each of its phases, so phases measured side by side share nothing but the host.

Scenarios (:mod:`benchmarks.celery_e2e.scenarios`; sizes by option, all task counts times
``--scale``):

* ``backlog``: ``--backlog-tasks`` (1,000) x 20 ms on ONE key, limit 2. ``baseline``: the tasks
  unguarded on a dedicated worker ``-c 2``; ``guarded``: ``@with_semaphore`` on one worker
  ``-c 4``; ``spread``: guarded on two workers ``-c 4``; ``head-of-line``: the guarded burst
  again, then ``--others`` (20) tasks for 20 other keys sent after it. Targets: pace (baseline
  makespan / makespan) >= 0.9 and contention re-publishes per task <= 0.1 for guarded and
  spread, no over-admission, the 20 others done within 1 s of their first send.
* ``uncontended``: ``--uncontended-tasks`` (600) x 10 ms over ``--uncontended-keys`` (300,
  round robin, limit 2) on one worker ``-c 4``, guarded and plain: throughput ratio >= 0.95.
* ``mixed``: the classic run below with modes ``fair,plain``: fair utilization >= 0.9, >= 0.95 x
  plain's, p99 wait <= 1.5 x the ideal p99, no over-admission.

``uncontended`` and ``mixed`` run ``--rounds`` (3) batches of each mode on the same workers, in
turns (guarded, plain; plain, guarded; ...), and take each figure as the median of the rounds':
a 2 s batch on a shared 2-vCPU host varies by 10-20% from one run to the next, far more than
the difference measured, and batches next to each other on the same workers see the same host.
Both also print the CPU a guarded and a plain task cost, in milliseconds per task, by process:
the workers' main processes, their pool children and the Redis servers on this host
(:mod:`benchmarks.cpu`; Linux only).

Without ``--scenario``, the classic run, on the Redis broker unless ``--brokers`` says
otherwise: N short tasks (``--tasks`` 400 x ``--duration`` 50 ms) over ``--keys`` (8) with
``--limit`` (3) per key on ``--workers`` (2) prefork workers x ``--concurrency`` (8), all sent
at once, keys in a seeded random order, in each of ``--modes`` (default ``fair,naive,plain``):

* ``fair``: ``@with_semaphore``, the plugin under test (its FIFO line per key).
* ``naive``: the same semaphore tried without joining the line, retried with a fixed countdown
  (``--naive-countdown``, 0.1 s), the usual pattern of Celery lock plugins.
* ``plain``: no semaphore at all.

Before each phase, ``--warmup`` uncontended guarded tasks (4 per slot, on keys and a task name
of their own) let every pool child connect to Redis and load the scripts, as a worker that has
been up for a while has; nothing the measured tasks learn (hold times, return delays) comes
from them. ``--warmup 0`` measures from cold children.

Each body counts itself in and out of a per-key counter that nothing else touches; a count
above the limit is an over-admission. ``wait`` is body start minus send time; ``re-pub`` counts
contention retries through the broker (the ``redsem_wait`` header's first element, or the
naive task's retries); ``deliv`` counts deliveries the workers received (``task_received``),
1.0 per task when nothing goes through the broker twice. The ideal is a simulated
work-conserving FIFO dispatcher with W slots and limit L per key, the same send times and the
measured mean body time: ``utilization`` = ideal makespan / real makespan, and ``p99 / ideal``
compares wait percentiles (``n/a`` when the ideal p99 is under 1 ms). ``--dump PATH`` writes
each phase's send times and body records to ``PATH.<broker>.<phase>.json`` for a closer look
(:mod:`benchmarks.celery_e2e.dump_report` shows where a batch lost time).

Pools (issue 38): ``--pool threads,gevent,eventlet`` runs each scenario on each pool
(``-c`` 20, 100 and 100 unless ``--pool-concurrency`` says otherwise, in place of prefork's
``-c 4`` and the mixed ``-c 8``; the backlog baseline is a worker of the same pool ``-c 2``,
the plain batches run on the same workers). Pace target there: >= 0.85. Two scenarios more,
not in ``all``: ``pools`` (:mod:`~benchmarks.celery_e2e.stops`: the burst run through, then
stopped mid-way by a SIGTERM and by a SIGKILL of its worker, with the ledger of every task,
:mod:`~benchmarks.celery_e2e.ledger`) and ``hot-mixed`` (:mod:`~benchmarks.celery_e2e.hot`:
2,000 x 100 ms over 200 keys, one hot, against the ideal). ``make bench-pools`` runs them.
Each scenario's host line ends with the pool and the 1-minute load average as it began.

The modules, by role: :mod:`~benchmarks.celery_e2e.app` (the workers' Celery app: the task
variants and what their bodies record; its configuration read from the environment in one
function), :mod:`~benchmarks.celery_e2e.worker` (what ``celery -A`` loads in a worker),
:mod:`~benchmarks.celery_e2e.harness` (starting workers, sending batches, collecting records),
:mod:`~benchmarks.celery_e2e.scenarios`, :mod:`~benchmarks.celery_e2e.tables` (the tables and
targets they print), :mod:`~benchmarks.celery_e2e.ideal` (the ideal dispatcher's arithmetic, no
Celery, no Redis), :mod:`~benchmarks.celery_e2e.dump_report` (the offline reader of ``--dump``
files, no Celery) and ``__main__`` (the command line).
"""
