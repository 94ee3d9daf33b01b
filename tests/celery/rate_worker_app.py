"""The app a ``celery worker`` subprocess runs for the rate-limit tests (set up from env)."""

from __future__ import annotations

import os

from tests.celery.rate_tasks import add_rate_tasks
from tests.celery.tasks import make_app

_url, _prefix = os.environ["REDSEM_TEST_APP_URL"], os.environ["REDSEM_TEST_APP_PREFIX"]
app = make_app(_url, _prefix)
add_rate_tasks(app, _url, _prefix)
