"""The marketplace's tasks, each guarded by celery_redsem.

* ``buy_item`` / ``sell_item``: at most 5 calls at once and 20 a second per account (the
  marketplace's published limits), shared by buying and selling because they use the same key.
  A sale offer stands for a few seconds: a sale that cannot start by then fails.
* ``stream_market_feed``: one long-running feed per account; a lock whose short lease the
  worker's heartbeat keeps alive for as long as the stream runs. A feed asked for while the
  account's feed streams is skipped.
* ``build_daily_report``: one build per day at a time; the fencing token keeps an older build
  from overwriting a newer one.
"""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task
from celery.utils.log import get_task_logger

from celery_redsem import (
    HeldPermit,
    contention_retries,
    current_permit,
    read_state,
    with_lock,
    with_rate_limit,
    with_semaphore,
)

from . import market_api

logger = get_task_logger(__name__)

#: The marketplace serves at most this many concurrent calls per account.
ACCOUNT_LIMIT = 5
#: ... and at most this many calls a second per account (a run starts only in its slot).
ACCOUNT_RATE = "20/s"
#: Seconds a sale offer stands: a sale that cannot start by then fails (AcquireTimeout).
OFFER_SECONDS = 3.0


def account_key(account_id: str) -> str:
    """One semaphore per account, shared by every market call of that account."""
    return f"market:{account_id}"


@shared_task(bind=True)
@with_semaphore(limit=ACCOUNT_LIMIT, key=account_key)
@with_rate_limit(ACCOUNT_RATE, key=account_key)
def buy_item(
    self: Any, account_id: str, item_id: str, seconds: float = 0.5, enqueued_at: float = 0.0
) -> str:
    """Buy ``item_id`` for ``account_id`` (a market call taking ``seconds``)."""
    waited = time.time() - enqueued_at if enqueued_at else 0.0
    market_api.call(account_id, f"buy {item_id}", seconds)
    market_api.purchase_done(account_id, waited, contention_retries(self.request))
    return f"{account_id} bought {item_id}"


@shared_task(bind=True)
@with_semaphore(limit=ACCOUNT_LIMIT, key=account_key, max_wait=OFFER_SECONDS)
@with_rate_limit(ACCOUNT_RATE, key=account_key)
def sell_item(self: Any, account_id: str, item_id: str, seconds: float = 0.5) -> str:
    """Sell ``item_id`` for ``account_id``; shares the account's limit with :func:`buy_item`.

    The offer stands for :data:`OFFER_SECONDS`: a sale still waiting for its turn by then
    fails with :class:`~celery_redsem.AcquireTimeout`.
    """
    market_api.call(account_id, f"sell {item_id}", seconds)
    return f"{account_id} sold {item_id}"


@shared_task(bind=True)
@with_lock(key=lambda account_id: f"feed:{account_id}", on_busy="skip")
def stream_market_feed(self: Any, account_id: str, seconds: float = 30.0) -> dict[str, Any]:
    """Follow the market feed of ``account_id`` for ``seconds``: one stream per account. A
    feed asked for while that account's feed streams is skipped (its state: SUCCESS, None).

    The stream runs far longer than a lease; the heartbeat renews the lock in the background.
    Each tick is published with the lock's fencing token, and the lowest lease left seen on the
    server is reported, to show that the heartbeat kept it alive.
    """
    permit = _permit()
    started = time.monotonic()
    ticks = 0
    lowest_left_ms: int | None = None
    while time.monotonic() - started < seconds:
        ticks += 1
        market_api.publish_tick(account_id, permit.token, ticks)
        state = read_state(permit.client, permit.name, prefix=permit.permit.prefix)
        mine = [h for h in state.holders if h.permit_id == permit.id]
        left = mine[0].remaining_ms if mine else 0
        lowest_left_ms = left if lowest_left_ms is None else min(lowest_left_ms, left)
        time.sleep(0.5)
    result = {
        "account_id": account_id,
        "ran_seconds": round(time.monotonic() - started, 1),
        "lease_seconds": permit.permit.lease,
        "ticks": ticks,
        "lowest_lease_left_ms": lowest_left_ms,
    }
    market_api.record_feed(account_id, result)
    return result


@shared_task(bind=True)
@with_lock(key=lambda day: f"report:{day}")
def build_daily_report(self: Any, day: str, seconds: float = 2.0) -> int:
    """Build the daily report of ``day`` (``YYYY-MM-DD``); one build per day at a time."""
    permit = _permit()
    started = time.time()
    time.sleep(seconds)  # gathering the day's trades
    market_api.store_report(day, permit.token, f"report of {day}")
    market_api.record_build(day, permit.token, started, time.time())
    logger.info("report %s stored with fencing token %s", day, permit.token)
    return permit.token


def _permit() -> HeldPermit:
    """The permit of the running task: its fencing token, its lease, whether it was lost."""
    permit = current_permit()
    assert permit is not None, "called outside a guarded task"
    return permit
