"""The app of the chaos test's ``celery worker`` subprocesses (``-A tests.scale.chaos_app``).

Broker and results live on the test server; the semaphores on a separate server that the test
kills and restarts, so the fault hits only the plugin's Redis.
"""

from __future__ import annotations

import os

from tests.integration.apps.tasks import make_app

app = make_app(
    os.environ["REDSEM_TEST_APP_URL"],
    os.environ["REDSEM_TEST_APP_PREFIX"],
    redsem_redis_url=os.environ["REDSEM_CHAOS_SEMAPHORE_URL"],
    redsem_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
)
