"""The declared version floors are the ones CI tests: pyproject.toml's, the oldest leg's pins
(.ci/test-oldest) and the README's "Supported versions" agree, and what is installed meets
them. No server needed."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # (pytest brings tomli there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
OLDEST = (ROOT / ".ci" / "test-oldest").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def declared() -> dict[str, str]:
    """Each dependency's floor (``name>=X``), as pyproject.toml declares it."""
    floors = {}
    for requirement in PROJECT["dependencies"]:
        name, floor = re.fullmatch(r"([a-z0-9_-]+)>=([0-9.]+)", requirement).groups()
        floors[name] = floor
    return floors


def pinned() -> dict[str, str]:
    """The oldest leg's ``==`` pins."""
    (pins,) = re.findall(r"^OLDEST_PINS=\((.*)\)$", OLDEST, re.MULTILINE)
    return dict(pin.split("==") for pin in pins.split())


def test_the_oldest_leg_pins_the_declared_floors() -> None:
    assert declared() == pinned()
    (python,) = re.findall(r"^OLDEST_PYTHON=(\S+)$", OLDEST, re.MULTILINE)
    assert PROJECT["requires-python"] == f">={python}"


def test_the_readme_names_the_floors() -> None:
    section = README.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    assert f"Python {PROJECT['requires-python'].removeprefix('>=')}" in section
    for name, floor in declared().items():
        assert f"{floor}" in section, name


def test_what_is_installed_meets_the_floors() -> None:
    for name, floor in declared().items():
        installed = re.match(r"[0-9.]+", metadata.version(name)).group().rstrip(".")
        assert _version(installed) >= _version(floor), (name, installed, floor)
    python = _version(PROJECT["requires-python"].removeprefix(">="))
    assert sys.version_info[: len(python)] >= python
