"""Fixtures of the example project's tests: Django set up for ``example_project/proj``.

``DJANGO_SETTINGS_MODULE`` and the example's environment are set here, for these tests only
(not in the pytest configuration). The broker is Kombu's in-memory transport, so no queue
touches the shared test server; the semaphores and the market's books live in real Redis under
per-test prefixes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "example_project"


@pytest.fixture(scope="session")
def example_app(redis_url: str) -> Any:
    """The example's Celery app, configured from its Django settings against the test server.

    The environment and ``sys.path`` are changed only while Django reads the settings and the
    modules are imported, then restored: worker subprocesses that other tests start later must
    not inherit ``DJANGO_SETTINGS_MODULE`` or the in-memory broker.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DJANGO_SETTINGS_MODULE", "proj.settings")
        mp.setenv("REDIS_URL", redis_url)
        mp.setenv("CELERY_BROKER_URL", "memory://")
        mp.syspath_prepend(str(EXAMPLE_DIR))
        import django

        django.setup()
        import market.tasks  # noqa: F401  (registers the tasks)
        from proj.celery import app

        app.loader.import_default_modules()
    return app


@pytest.fixture
def example(example_app: Any, prefix: str, settings_override: None) -> Iterator[Any]:
    """The app with this test's own key prefix for semaphores (and for the market's books)."""
    from celery_redsem.integration.settings import reset

    example_app.conf.redsem_key_prefix = prefix
    reset(example_app)
    yield example_app
    reset(example_app)


@pytest.fixture
def settings_override(example_app: Any, prefix: str) -> Iterator[None]:
    from django.test import override_settings

    with override_settings(MARKET_KEY_PREFIX=f"{prefix}:market-api"):
        yield


@pytest.fixture
def account() -> str:
    return f"acct-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def eager(example: Any) -> Iterator[Any]:
    """Tasks run inline (``task_always_eager``): a guarded task blocks for its permit."""
    example.conf.task_always_eager = True
    yield example
    example.conf.task_always_eager = False
