"""The Lua scripts: loading them from package data and running them with EVALSHA.

Each script is one ``.lua`` file in ``celery_redsem/core/lua`` with a contract header; the shared
helpers in ``_common.lua`` are inserted at load time where the script has the line
``-- @common``, else at its top. (acquire and release put the line after their fast path,
which runs on every task start and end: creating the helpers is a measurable part of its
cost on the server.) :class:`LuaScript` runs a script in one
round trip with ``EVALSHA`` and falls back to ``SCRIPT LOAD`` when the server answers
``NOSCRIPT`` (after a restart or ``SCRIPT FLUSH``), and to ``EVAL`` if the cache was flushed
again before the reload ran, so callers never see that error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

from celery_redsem.core.errors import REDIS_ERRORS, BackendError

__all__ = [
    "ACQUIRE",
    "COALESCE",
    "DEDUPE",
    "PAUSE",
    "REFRESH",
    "RELEASE",
    "STATE",
    "LuaScript",
    "as_text",
    "run_script",
    "script_failed",
]


def _read(name: str) -> str:
    return (
        resources.files("celery_redsem.core")
        .joinpath("lua")
        .joinpath(name)
        .read_text(encoding="utf-8")
    )


@cache
def _common() -> str:
    return _read("_common.lua")


COMMON_MARKER = "-- @common\n"
#: Where a fair-share script wants the fair-share helpers (``_fair.lua``), after the common ones.
FAIR_MARKER = "-- @fair\n"


def with_common(script: str) -> str:
    """``script`` with the shared helpers in place of its ``-- @common`` line (or on top), and
    the fair-share helpers in place of its ``-- @fair`` line if it has one."""
    if FAIR_MARKER in script:
        script = script.replace(FAIR_MARKER, _read("_fair.lua") + "\n", 1)
    if COMMON_MARKER in script:
        return script.replace(COMMON_MARKER, _common() + "\n", 1)
    return _common() + "\n" + script


class LuaScript:
    """One server-side script, run by SHA with a transparent reload on ``NOSCRIPT``."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.source = with_common(_read(filename))
        self.sha = hashlib.sha1(self.source.encode("utf-8"), usedforsecurity=False).hexdigest()
        self.sha_bytes = self.sha.encode()  # sent as is; redis-py would encode a str each call

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on ``client`` (a redis-py client or pipeline) and return its reply.

        Sent with ``execute_command``, which ``evalsha()`` wraps in two more calls: acquire and
        release run on every task start and end, and their client-side cost is measured.
        """
        try:
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return self.load_and_call(client, keys, args)

    def load_and_call(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Load the script (the server answered ``NOSCRIPT``), then run it; if the cache was
        flushed again in between, run it from its source (``EVAL``, which caches it too)."""
        client.script_load(self.source)
        try:
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return client.execute_command("EVAL", self.source, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"<LuaScript {self.filename} {self.sha[:8]}>"


ACQUIRE = LuaScript("acquire.lua")
RELEASE = LuaScript("release.lua")
REFRESH = LuaScript("refresh.lua")
STATE = LuaScript("state.lua")
GCRA = LuaScript("gcra.lua")
RATE_STATE = LuaScript("rate_state.lua")
DEDUPE = LuaScript("dedupe.lua")
PAUSE = LuaScript("pause.lua")
COALESCE = LuaScript("coalesce.lua")


def as_text(value: bytes | str) -> str:
    """A reply as str, whether the client decodes replies or not."""
    return value.decode() if isinstance(value, bytes) else value


def script_failed(script: LuaScript, name: str, exc: BaseException) -> BackendError:
    """The BackendError for ``script`` failing on semaphore ``name`` with ``exc``."""
    return BackendError(f"Redis failed during {script.filename} for {name!r}: {exc}", name=name)


def run_script(script: LuaScript, client: Any, keys: list[str], args: list[Any], name: str) -> Any:
    """Run ``script`` on ``client``; a Redis error becomes a BackendError about ``name``."""
    try:
        return script(client, keys, args)
    except REDIS_ERRORS as exc:
        raise script_failed(script, name, exc) from exc
