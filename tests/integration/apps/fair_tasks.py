"""Tasks for fair share by account (issue 40), on an app of their own.

Each body counts itself with an independent counter in Redis, as tests/integration/apps/tasks.py
does: ``<prefix>:f:cur:<key>`` / ``<prefix>:f:max:<key>`` (running now / most at once, over
every account), the same per account (``...:<key>:<account>``), and ``<prefix>:f:log:<key>``
(``start <account> <task id>`` in order). A body given ``hold=True`` waits for
``<prefix>:f:go:<key>``.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery

from celery_redsem import with_semaphore
from tests.integration.apps.tasks import body_client, make_app

_ENTER = """
for i = 1, 3, 2 do
  local c = redis.call('INCR', KEYS[i])
  if c > tonumber(redis.call('GET', KEYS[i + 1]) or '0') then redis.call('SET', KEYS[i + 1], c) end
end
redis.call('RPUSH', KEYS[5], 'start ' .. ARGV[1])
return 1
"""


def make_fair_app(redis_url: str, prefix: str, **conf: Any) -> Celery:
    """The test app of tests/integration/apps/tasks.py with the tasks of this module added."""
    app = make_app(redis_url, prefix, **conf)
    counter = body_client(redis_url)

    def body(key: str, account: str, task_id: str, seconds: float, hold: bool) -> str:
        total, mine = f"{prefix}:f:cur:{key}", f"{prefix}:f:cur:{key}:{account}"
        most, most_mine = f"{prefix}:f:max:{key}", f"{prefix}:f:max:{key}:{account}"
        counter().eval(
            _ENTER, 5, total, most, mine, most_mine, f"{prefix}:f:log:{key}", f"{account} {task_id}"
        )
        try:
            if hold:
                counter().blpop([f"{prefix}:f:go:{key}"], timeout=30)
            time.sleep(seconds)
        finally:
            counter().decr(total)
            counter().decr(mine)
        return account

    @app.task(bind=True, shared=False, name="f.call")
    @with_semaphore(
        limit=2,
        key=lambda key: f"fair:{key}",
        fair_by=lambda account: account,
        weight=lambda plan: 2 if plan == "pro" else 1,
    )
    def call(
        self: Any,
        key: str,
        account: str,
        plan: str = "std",
        seconds: float = 0.05,
        hold: bool = False,
    ) -> str:
        return body(key, account, self.request.id, seconds, hold)

    @app.task(bind=True, shared=False, name="f.capped")
    @with_semaphore(
        limit=3, key=lambda key: f"capped:{key}", fair_by=lambda account: account, group_limit=1
    )
    def capped(self: Any, key: str, account: str, seconds: float = 0.05) -> str:
        return body(key, account, self.request.id, seconds, False)

    @app.task(shared=False, name="f.bad_group")
    @with_semaphore(limit=2, key="bad-group", fair_by=lambda account: {"x": 1}[account])
    def bad_group(account: str) -> str:
        return account

    return app
