"""A short run of the example project with its Prometheus metrics on: a real ``celery -A proj
worker`` (prefork, ``PROMETHEUS_MULTIPROC_DIR`` set, as docs/metrics.rst says) on a private
server, scraped over HTTP while its tasks grant, wait, park, skip, time out and lose a lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from celery_redsem import FairSemaphore
from example_project.demo import stop_process_group
from tests.example.conftest import EXAMPLE_DIR
from tests.servers import PORT_TAKEN, PORT_TRIES, embedded_valkey, free_port, wait_until

pytestmark = pytest.mark.slow

PREFIX = "example"  # CELERY_REDSEM_KEY_PREFIX of the example's settings
BUY, SELL = "market.tasks.buy_item", "market.tasks.sell_item"
FEED, REPORT = "market.tasks.stream_market_feed", "market.tasks.build_daily_report"
#: What serve_metrics logs when it cannot serve on the port it was given.
REFUSED = "cannot serve metrics on"
WORKER = [sys.executable, "-m", "celery", "-A", "proj", "worker", "-P", "prefork"]


class Scraper:
    def __init__(self, port: int, worker: subprocess.Popen[bytes], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.worker = worker
        self.log = log

    def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every ``redsem_*`` sample now, by name and labels (empty before the server is up)."""
        assert self.worker.poll() is None, self.log.read_text(errors="replace")[-3000:]
        try:
            with urllib.request.urlopen(self.url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return {}
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            if family.name.startswith("redsem_")
            for sample in family.samples
        }

    def refused(self) -> bool:
        """Whether the worker logged that it cannot serve its metrics (it runs without)."""
        return REFUSED in self.log.read_text(errors="replace")

    def settled(self) -> bool:
        """Whether the worker serves its metrics, could not, or exited."""
        return self.worker.poll() is not None or self.refused() or bool(self.samples())

    def value(self, name: str, **labels: str) -> float:
        return self.samples().get((name, frozenset(labels.items())), 0.0)

    def reaches(self, name: str, at_least: float, **labels: str) -> None:
        wait_until(
            lambda: self.value(name, **labels) >= at_least,
            30,
            interval=0.1,
            what=f"{name}{labels} >= {at_least}",
        )


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[str, Scraper]]:
    """A private server and the example's worker on it, its metrics served on a free port
    (another one if some other process takes the first before the worker binds it)."""
    with embedded_valkey() as url:
        env = {
            **os.environ,
            "REDIS_URL": url,
            "CELERY_BROKER_URL": url,
            "DJANGO_SETTINGS_MODULE": "proj.settings",
        }
        for tries_left in reversed(range(PORT_TRIES)):
            port = free_port()
            log = tmp_path / f"worker-{port}.log"
            multiproc_dir = tmp_path / f"prometheus-{port}"  # (none of a refused worker's)
            multiproc_dir.mkdir()
            with log.open("wb") as out:
                worker = subprocess.Popen(
                    [*WORKER, "-c", "3", "-l", "INFO", "--without-gossip", "--without-mingle"],
                    cwd=EXAMPLE_DIR,
                    env={
                        **env,
                        "REDSEM_METRICS_PORT": str(port),
                        "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir),
                    },
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            scraper = Scraper(port, worker, log)
            try:
                wait_until(scraper.settled, 60, interval=0.2, what="the worker's /metrics")
                if not scraper.refused():
                    break
                text = log.read_text(errors="replace")
                assert PORT_TAKEN in text, text[-3000:]
                assert tries_left, f"{PORT_TRIES} metrics ports taken in a row"
            except BaseException:
                stop_process_group(worker, signal.SIGTERM, grace=10)
                raise
            stop_process_group(worker, signal.SIGTERM, grace=10)  # and on to another port
        try:
            yield url, scraper
        finally:
            stop_process_group(worker, signal.SIGTERM, grace=10)


def test_a_short_run_of_the_example_moves_every_metric(run: tuple[str, Scraper]) -> None:
    url, metrics = run
    client = redis.Redis.from_url(url)
    sender = Celery("sender", broker=url, set_as_current=False)
    try:
        assert metrics.value("redsem_parked_tasks") == 0
        assert not any(name == "redsem_grants_total" for name, _ in metrics.samples())

        # A burst of purchases: the account's rate limit (under its semaphore) sends some
        # back for a later slot, each giving its grant back; one grant counts per purchase.
        for i in range(10):
            sender.send_task(BUY, ("dave", f"item-{i}", 0.01))
        wait_until(lambda: client.hget("market-api:done", "dave") == b"10", 60, what="10 purchases")
        assert metrics.value("redsem_grants_total", task=BUY) == 10
        assert metrics.value("redsem_wait_seconds_count", task=BUY) == 10

        # A feed streams; a second one for the same account is skipped (on_busy="skip").
        feed = FairSemaphore(client, "feed:bob", 1, prefix=PREFIX)
        sender.send_task(FEED, ("bob", 60.0))
        wait_until(feed.holders, 60, what="the feed to hold its lock")
        sender.send_task(FEED, ("bob", 60.0))
        metrics.reaches("redsem_skips_total", 1, task=FEED)

        # A sale on an account whose 5 permits are all taken: it waits, then its offer expires.
        carol = FairSemaphore(client, "market:carol", 5, prefix=PREFIX, lease=60)
        taken = [carol.acquire() for _ in range(5)]
        sender.send_task(SELL, ("carol", "sword", 0.01))
        metrics.reaches("redsem_waits_total", 1, task=SELL, how="retry")

        # A report build behind the test's hold of its lock is parked in the worker's main
        # process, then granted there when the lock is released.
        report = FairSemaphore(client, "report:2026-01-31", 1, prefix=PREFIX, lease=60)
        blocker = report.acquire()
        assert blocker is not None
        sender.send_task(REPORT, ("2026-01-31", 0.01))
        metrics.reaches("redsem_parked_tasks", 1)
        metrics.reaches("redsem_waits_total", 1, task=REPORT, how="park")
        assert metrics.value("redsem_grants_total", task=REPORT) == 0
        report.release(blocker)
        metrics.reaches("redsem_grants_total", 1, task=REPORT)
        assert metrics.value("redsem_parked_tasks") == 0
        assert metrics.value("redsem_wait_seconds_count", task=REPORT) == 1
        assert metrics.value("redsem_wait_seconds_sum", task=REPORT) > 0  # it waited
        assert metrics.value("redsem_wait_seconds_bucket", task=REPORT, le="+Inf") == 1

        # An operator takes the feed's lock away: the worker's heartbeat finds the lease lost.
        [streaming] = feed.holders()
        assert feed.release(streaming.permit_id)
        metrics.reaches("redsem_lost_leases_total", 1, task=FEED)

        metrics.reaches("redsem_timeouts_total", 1, task=SELL)
        for permit in taken:
            assert permit is not None
            carol.release(permit)
        assert metrics.value("redsem_grants_total", task=SELL) == 0
        metrics.reaches("redsem_grants_total", 1, task=FEED)  # (counted by its pool child)
        assert metrics.value("redsem_grants_total", task=FEED) == 1
        assert metrics.value("redsem_wait_seconds_count", task=FEED) == 1
    finally:
        sender.close()
        client.close()
