"""The app a ``celery worker`` subprocess runs (``-A tests.integration.apps.worker_app``), set up
from env.

``REDSEM_TEST_APP_CONF`` holds app settings as JSON; ``test_child_init_sleep`` (seconds) is
not one: it makes every pool child sleep that long in ``worker_process_init``, as a child with
a heavy start-up does.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery.signals import worker_process_init

from tests.integration.apps.tasks import make_app

_conf: dict[str, Any] = json.loads(os.environ.get("REDSEM_TEST_APP_CONF", "{}"))
_child_init_sleep = float(_conf.pop("test_child_init_sleep", 0.0))

app = make_app(os.environ["REDSEM_TEST_APP_URL"], os.environ["REDSEM_TEST_APP_PREFIX"], **_conf)


@worker_process_init.connect(weak=False)
def _slow_child_start(**_: object) -> None:
    if _child_init_sleep:
        time.sleep(_child_init_sleep)
