"""The Lua scripts: loading them from package data and running them with EVALSHA.

Each script is one ``.lua`` file in ``celery_redsem/lua`` with a contract header; the shared
helpers in ``_common.lua`` are prepended at load time. :class:`LuaScript` runs a script in one
round trip with ``EVALSHA`` and falls back to ``SCRIPT LOAD`` when the server answers
``NOSCRIPT`` (after a restart or ``SCRIPT FLUSH``), so callers never see that error.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

__all__ = ["ACQUIRE", "REFRESH", "RELEASE", "STATE", "LuaScript"]


def _read(name: str) -> str:
    return (
        resources.files("celery_redsem").joinpath("lua").joinpath(name).read_text(encoding="utf-8")
    )


@cache
def _common() -> str:
    return _read("_common.lua")


class LuaScript:
    """One server-side script, run by SHA with a transparent reload on ``NOSCRIPT``."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.source = _common() + "\n" + _read(filename)
        self.sha = hashlib.sha1(self.source.encode("utf-8"), usedforsecurity=False).hexdigest()

    def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        """Run the script on ``client`` (a redis-py client or pipeline) and return its reply."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"<LuaScript {self.filename} {self.sha[:8]}>"


ACQUIRE = LuaScript("acquire.lua")
RELEASE = LuaScript("release.lua")
REFRESH = LuaScript("refresh.lua")
STATE = LuaScript("state.lua")
