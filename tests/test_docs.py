"""The docs list every ``redsem_*`` setting the code reads, each exactly once, and nothing else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import celery_redsem
from celery_redsem.integration.settings import SETTINGS

PACKAGE = Path(celery_redsem.__file__).parent
DOCS = Path(__file__).resolve().parent.parent / "docs"
SETTING_NAME = re.compile(r"redsem_[a-z][a-z0-9_]*")
CONFVAL = re.compile(r"^\.\. confval:: (\S+)\s*$", re.MULTILINE)


def not_settings() -> set[str]:
    """``redsem_*`` strings of the package that are not settings (a message header, ...)."""
    from celery_redsem.integration import wire

    return {wire.WAIT_HEADER, wire.GRANT_FIELD, wire.DUPLICATE_FIELD, wire.STANDBY_FIELD}


def _owner_name(node: ast.expr) -> str:
    return str(getattr(node, "attr", getattr(node, "id", "")))


def names_read_by_the_code() -> set[str]:
    """``redsem_*`` names in string literals and ``conf.redsem_*`` attributes of the package.

    Attribute names on other objects (``setattr(request, "redsem_permit", ...)``) are not
    settings; any other ``redsem_*`` string that is not a setting belongs in :func:`not_settings`.
    """
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip: set[int] = set()
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and _owner_name(node.func) in {"getattr", "setattr", "hasattr", "delattr"}
                and len(node.args) >= 2
                and "conf" not in _owner_name(node.args[0])
            ):
                skip.add(id(node.args[1]))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if SETTING_NAME.fullmatch(node.value) and id(node) not in skip:
                    found.add(node.value)
            elif (
                isinstance(node, ast.Attribute)
                and SETTING_NAME.fullmatch(node.attr)
                and "conf" in _owner_name(node.value)
            ):
                found.add(node.attr)
    return found - not_settings()


def documented() -> list[str]:
    return CONFVAL.findall((DOCS / "configuration.rst").read_text(encoding="utf-8"))


def test_the_settings_table_covers_every_name_the_code_reads():
    found = names_read_by_the_code()
    assert {"redsem_redis_url", "redsem_lease"} <= found  # the scan itself works
    assert found - {s.name for s in SETTINGS} == set()


def test_every_setting_is_documented_exactly_once():
    names = documented()
    duplicates = {n for n in names if names.count(n) > 1}
    assert duplicates == set()
    assert set(names) == {s.name for s in SETTINGS}


def test_documented_defaults_match_the_code():
    text = (DOCS / "configuration.rst").read_text(encoding="utf-8")
    for setting in SETTINGS:
        block = text.split(f".. confval:: {setting.name}\n", 1)[1].split(".. confval::", 1)[0]
        (default,) = re.findall(r":default: ``(.*?)``", block)
        assert default == repr(setting.default).replace("'", '"'), setting.name


def test_the_django_spelling_is_explained():
    text = (DOCS / "configuration.rst").read_text(encoding="utf-8")
    assert "CELERY_REDSEM_" in text
