"""The app a ``celery worker`` subprocess runs for the rate-limit tests (set up from env):
the test app with the ``r.*`` tasks, or with ``REDSEM_TEST_RATE_ONLY=1`` an app whose only
guarded task is rate limited; ``REDSEM_TEST_APP_CONF`` (JSON) holds more app settings."""

from __future__ import annotations

import json
import os

from tests.integration.apps.rate_tasks import make_rate_app, make_rate_only_app

_url, _prefix = os.environ["REDSEM_TEST_APP_URL"], os.environ["REDSEM_TEST_APP_PREFIX"]
if os.environ.get("REDSEM_TEST_RATE_ONLY") == "1":
    app = make_rate_only_app(_url, _prefix)
else:
    app = make_rate_app(_url, _prefix)
app.conf.update(json.loads(os.environ.get("REDSEM_TEST_APP_CONF", "{}")))
