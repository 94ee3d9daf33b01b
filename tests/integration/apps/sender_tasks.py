"""A tasks module as a web process imports it: a plain ``Celery`` app that nothing finalizes,
with ``dedupe`` tasks; its sends must take their marks all the same (issue 39, item 1). Set up
from the environment as :mod:`.worker_app` is."""

from __future__ import annotations

import os

from celery import Celery

from celery_redsem import with_lock
from tests.integration.apps.tasks import app_settings

app = Celery("senders", set_as_current=False)
app.conf.update(
    app_settings(os.environ["REDSEM_TEST_APP_URL"], os.environ["REDSEM_TEST_APP_PREFIX"])
)


@app.task(name="s.build")
@with_lock(key=lambda report_id: f"build:{report_id}", dedupe=True)
def build(report_id: str) -> str:
    return report_id


@app.task(name="s.build_or_raise")
@with_lock(key=lambda report_id: f"build-raise:{report_id}", dedupe="raise")
def build_or_raise(report_id: str) -> str:
    return report_id
