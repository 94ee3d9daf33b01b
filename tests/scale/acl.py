"""The ACL rule documented in docs/scaling.rst, read from the docs so the tests check the docs."""

from __future__ import annotations

from pathlib import Path

import redis

import celery_redsem

DOCS = Path(__file__).resolve().parents[2] / "docs" / "scaling.rst"
LUA = Path(celery_redsem.__file__).parent / "core" / "lua"
PASSWORD = "pw-Zq7!never-shown"


def documented_acl_rule() -> str:
    """The ``ACL SETUSER`` rule of docs/scaling.rst, on one line."""
    text = DOCS.read_text(encoding="utf-8")
    block = text.split(".. acl-rule-start", 1)[1].split(".. acl-rule-end", 1)[0]
    lines = [line.strip() for line in block.splitlines()]
    return " ".join(line for line in lines if line and not line.startswith(".."))


def acl_words(prefix: str, user: str) -> list[str]:
    """The documented rule's arguments to ACL SETUSER, for ``user`` and key ``prefix``."""
    words = documented_acl_rule().split()
    assert words[:3] == ["ACL", "SETUSER", "redsem"]
    assert "~redsem:*" in words
    assert ">CHANGE-ME" in words
    swap = {"~redsem:*": f"~{prefix}:*", "&redsem:*": f"&{prefix}:*", ">CHANGE-ME": f">{PASSWORD}"}
    return [user] + [swap.get(w, w) for w in words[3:]]


def create_user(client: redis.Redis, prefix: str, user: str) -> None:
    client.execute_command("ACL", "SETUSER", *acl_words(prefix, user))
