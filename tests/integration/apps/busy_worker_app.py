"""The app a ``celery worker`` subprocess runs for tests/integration/test_busy_workers.py."""

from __future__ import annotations

import json
import os

from tests.integration.apps.busy_tasks import make_busy_app

app = make_busy_app(
    os.environ["REDSEM_TEST_APP_URL"],
    os.environ["REDSEM_TEST_APP_PREFIX"],
    **json.loads(os.environ.get("REDSEM_TEST_APP_CONF", "{}")),
)
