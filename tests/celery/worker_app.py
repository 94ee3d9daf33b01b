"""The app a ``celery worker`` subprocess runs (``-A tests.celery.worker_app``), set up from env."""

from __future__ import annotations

import json
import os

from tests.celery.tasks import make_app

app = make_app(
    os.environ["REDSEM_TEST_APP_URL"],
    os.environ["REDSEM_TEST_APP_PREFIX"],
    **json.loads(os.environ.get("REDSEM_TEST_APP_CONF", "{}")),
)
