"""``python manage.py enqueue_purchases alice bob --count 10``: enqueue a burst of market work."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from market.tasks import build_daily_report, buy_item, sell_item, stream_market_feed


class Command(BaseCommand):
    help = "Enqueue purchases (and sales, feeds, a report build) for accounts."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("accounts", nargs="+", help="account ids")
        parser.add_argument("--count", type=int, default=10, help="purchases per account")
        parser.add_argument("--sell", type=int, default=0, help="sales per account")
        parser.add_argument("--seconds", type=float, default=0.5, help="duration of one purchase")
        parser.add_argument("--feed", type=float, metavar="SECONDS", help="also stream feeds")
        parser.add_argument("--report", metavar="DAY", help="also build the report of DAY")

    def handle(self, *args: Any, **options: Any) -> None:
        ids = []
        for account in options["accounts"]:
            for i in range(options["count"]):
                ids.append(buy_item.delay(account, f"item-{i}", options["seconds"], time.time()).id)
            for i in range(options["sell"]):
                ids.append(sell_item.delay(account, f"item-{i}", options["seconds"]).id)
            if options["feed"]:
                ids.append(stream_market_feed.delay(account, options["feed"]).id)
        if options["report"]:
            ids.append(build_daily_report.delay(options["report"]).id)
        self.stdout.write(f"Enqueued {len(ids)} tasks.")
