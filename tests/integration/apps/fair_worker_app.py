"""The app a ``celery worker`` subprocess runs for tests/integration/test_fair_workers.py."""

from __future__ import annotations

import json
import os

from tests.integration.apps.fair_tasks import make_fair_app

app = make_fair_app(
    os.environ["REDSEM_TEST_APP_URL"],
    os.environ["REDSEM_TEST_APP_PREFIX"],
    **json.loads(os.environ.get("REDSEM_TEST_APP_CONF", "{}")),
)
