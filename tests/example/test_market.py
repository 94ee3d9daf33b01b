"""The example marketplace: its settings, tasks, view and command, with a real worker and Redis."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time

import pytest
from celery.contrib.testing.worker import start_worker

from celery_redsem import FairSemaphore, Permit, get_client, get_config
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.integration.guards.base import guards_of
from celery_redsem.integration.guards.rate_guard import RateGuard
from celery_redsem.integration.guards.semaphore_guard import SemaphoreGuard
from celery_redsem.integration.settings import SETTINGS
from tests.example.conftest import EXAMPLE_DIR
from tests.servers import wait_until


def test_settings_use_the_celery_namespace_and_only_real_redsem_settings(example_app):
    from django.conf import settings

    names = {n for n in dir(settings) if n.startswith("CELERY_REDSEM_")}
    assert names
    known = {f"CELERY_{s.name.upper()}" for s in SETTINGS}
    assert names <= known, names - known
    config = get_config(example_app)
    assert config.lease == settings.CELERY_REDSEM_LEASE
    assert config.lost_lease_policy == "raise"


def test_tasks_are_autodiscovered_and_guarded(example_app):
    from market import tasks

    assert "market.tasks.buy_item" in example_app.tasks
    (buy,) = guards_of(tasks.buy_item, SemaphoreGuard)
    (sell,) = guards_of(tasks.sell_item, SemaphoreGuard)
    assert (buy.limit, sell.limit) == (5, 5)
    # Buying and selling for one account share one semaphore.
    args = (None, "alice", "sword")
    assert buy.name_for("buy", args, {}) == sell.name_for("sell", args, {}) == "market:alice"
    (report,) = guards_of(tasks.build_daily_report, SemaphoreGuard)
    assert report.limit == 1
    assert report.name_for("r", (None, "2026-01-01"), {}) == "report:2026-01-01"


def test_a_burst_on_a_real_worker_never_exceeds_five_per_account(example, account):
    from market import market_api, tasks

    other = f"{account}-b"
    with start_worker(example, pool="threads", concurrency=10, perform_ping_check=False):
        for i in range(12):
            tasks.buy_item.delay(account, f"item-{i}", 0.3, time.time())
        for i in range(3):
            tasks.buy_item.delay(other, f"item-{i}", 0.3, time.time())

        def done() -> bool:
            books = market_api.books([account, other])
            return books[account]["done"] == 12 and books[other]["done"] == 3

        wait_until(done, 60, interval=0.1, what="15 purchases")
    books = market_api.books([account, other])
    assert books[account]["peak"] == 5  # the limit was reached ...
    assert books[account]["rejected"] == 0  # ... and never exceeded
    assert books[other]["rejected"] == 0
    sem = FairSemaphore(
        get_client(example), f"market:{account}", 5, prefix=get_config(example).key_prefix
    )
    assert sem.holders() == []


def test_purchases_keep_the_accounts_published_rate(example, account, monkeypatch):
    """Short purchases that five at a time would start hundreds a second: the account's rate
    (``ACCOUNT_RATE``, 20/s, under its semaphore) spaces them, across the worker's threads."""
    from market import market_api, tasks

    (rate,) = guards_of(tasks.buy_item, RateGuard)
    assert rate.rate == 20.0
    # Refused purchases come back through the in-memory broker: poll it often.
    monkeypatch.setitem(example.conf, "broker_transport_options", {"polling_interval": 0.01})
    with start_worker(example, pool="threads", concurrency=10, perform_ping_check=False):
        for i in range(12):
            tasks.buy_item.delay(account, f"item-{i}", 0.01, time.time())
        wait_until(
            lambda: market_api.books([account])[account]["done"] == 12,
            60,
            interval=0.05,
            what="12 purchases",
        )
    assert market_api.books([account])[account]["rejected"] == 0
    # The limiter's line remembers when it admitted each purchase (server time, microseconds).
    line = SemaphoreKeys(get_config(example).key_prefix, f"market:{account}").rate_line
    client = get_client(example)
    admitted = sorted(-s / 1e6 for _, s in client.zrange(line, 0, -1, withscores=True) if s < 0)
    assert len(admitted) == 12
    for i, j in itertools.combinations(range(12), 2):  # burst 1: at most 1 + span x 20
        assert j - i + 1 <= 1 + (admitted[j] - admitted[i]) * 20 + 1e-3


def test_the_report_lock_passes_its_fencing_token_to_the_store(eager, account):
    from market import market_api, tasks

    day = f"day-{account}"
    first = tasks.build_daily_report.delay(day, 0.01).get()
    second = tasks.build_daily_report.delay(day, 0.01).get()
    assert second > first
    with pytest.raises(market_api.StaleToken):
        market_api.store_report(day, first, "an older build, late")
    assert [b[0] for b in market_api.builds(day)] == [first, second]


def test_the_view_enqueues_a_purchase(eager, account):
    from django.test import Client
    from market import market_api

    client = Client()
    response = client.post("/market/buy/", {"account": account, "item": "sword"})
    assert response.status_code == 202
    assert response.json()["task_id"]
    assert market_api.books([account])[account]["done"] == 1
    assert client.post("/market/buy/", {"account": account}).status_code == 400
    limits = client.get("/market/limits/")
    assert limits.status_code == 200
    assert limits.json()["total"] == 1


def test_the_management_command_enqueues_purchases(eager, account):
    from django.core.management import call_command
    from market import market_api

    call_command("enqueue_purchases", account, "--count", "3", "--sell", "2", "--seconds", "0.01")
    assert market_api.books([account])[account]["done"] == 3
    calls = [e for e in market_api.events() if e[1] == account]
    assert len(calls) == 2 * 5  # 3 purchases + 2 sales, each counted in and out


@pytest.mark.slow
def test_celery_redsem_status_from_the_example_directory(example, account, redis_url, prefix):
    sem = FairSemaphore(get_client(example), f"market:{account}", 5, prefix=prefix, lease=30)
    held = sem.acquire(permit_id="task-xyz")
    assert isinstance(held, Permit)
    env = {**os.environ, "REDIS_URL": redis_url, "DJANGO_SETTINGS_MODULE": "proj.settings"}

    def redsem(*args: str) -> str:
        """``celery -A proj redsem --prefix PREFIX ARGS`` run from the example's directory."""
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "proj", "redsem", "--prefix", prefix, *args],
            cwd=EXAMPLE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout

    out = redsem("status")
    assert re.search(rf"market:{account}\s+limit 5\s+held 1/5", out), out
    assert "holder  task-xyz" in out
    as_json = redsem("inspect", f"market:{account}", "--json")
    assert json.loads(as_json)["holders"][0]["permit_id"] == "task-xyz"


def test_the_fixture_leaves_no_environment_behind(example_app):
    # Worker subprocesses of other tests must not inherit the example's settings or broker.
    assert os.environ.get("DJANGO_SETTINGS_MODULE") != "proj.settings"
    assert os.environ.get("CELERY_BROKER_URL") != "memory://"
    assert str(EXAMPLE_DIR) not in sys.path
