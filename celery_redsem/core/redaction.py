"""The one redactor: every message that shows a URL, a setting or an options dict uses it.

- :func:`redact_url` hides the password of a URL (str or bytes, with or without a scheme,
  ``user:password@``, ``:password@``, ``?password=``/``?ssl_password=``, ``;``-separated
  Sentinel lists, comma-separated cluster nodes).
- :func:`redacted` copies a value (a setting, an options dict, a list of URLs ...) with every
  secret replaced by ``***``: the value of any key that names a secret (``password``,
  ``ssl_password``, ``sentinel_kwargs``' ``password``, ``credential_provider``, ...; keys
  may be of any type, dicts nested) and the password of every URL in it. Usernames stay.
- :func:`safe_repr` is ``repr(redacted(value))``, scrubbed once more of every secret found.
- :func:`scrub` removes the secrets of given URLs or options from a text someone else wrote
  (a parser's or redis-py's error message).

Over-redacting is the safe side: anything before the last ``@`` of an address is treated
as user information, and a string without a scheme loses all of it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["HIDDEN", "is_secret_key", "redact_url", "redacted", "safe_repr", "scrub"]

HIDDEN = "***"

_SECRET_KEY = re.compile(r"(?i)pass|pwd|secret|token|credential|auth")
_SECRET_QUERY = re.compile(r"(?i)([?&]\w*password=)[^&#;]*")
_SECRET_IN_QUERY = re.compile(r"(?i)\w*password=([^&#;]*)")
_SEPARATORS = re.compile(r"[/?#;@:&]")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_MIN_PIECE = 3  # shorter fragments of a password are not scrubbed out of other text


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def is_secret_key(key: object) -> bool:
    """True if an option or setting named ``key`` holds a secret (its value is never shown)."""
    return bool(_SECRET_KEY.search(_text(key) if isinstance(key, str | bytes) else str(key)))


def redact_url(url: str | bytes) -> str:
    """``url`` with every password replaced by ``***``, safe for logs and error messages.

    Handles ``;``-separated Sentinel lists, comma-separated cluster nodes, ``?password=`` (and
    ``?ssl_password=`` ...), passwords with ``/``, ``?``, ``#``, ``;`` or ``@`` in them (all of
    the address up to its last ``@`` is treated as the user part), addresses without a scheme
    (``:password@host``, ``password@host``) and bytes.
    """
    text = _text(url) if isinstance(url, str | bytes) else str(url)
    chunks = text.split(";") if text.lower().startswith("sentinel://") else [text]
    return ";".join(_redact_one(chunk) for chunk in chunks)


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://") if _SCHEME.match(url) else ("", "", url)
    userinfo, at, after = rest.rpartition("@")
    if at and ":" in userinfo:
        url = f"{scheme}{sep}{userinfo.split(':', 1)[0]}:{HIDDEN}@{after}"
    elif at and ("/" in userinfo or not sep):  # no user:password form, but not a plain user
        url = f"{scheme}{sep}{HIDDEN}@{after}"
    return _SECRET_QUERY.sub(rf"\1{HIDDEN}", url)


def redacted(value: Any) -> Any:
    """A copy of ``value`` fit to show: secrets under secret keys and in URLs are ``***``.

    Mappings (nested too) come back as dicts, lists and tuples as lists and tuples, str as
    :func:`redact_url` gives it, bytes as bytes; any other value unchanged.
    """
    if isinstance(value, Mapping):
        return {
            redacted(key): HIDDEN if is_secret_key(key) and item is not None else redacted(item)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redacted(item) for item in value)
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, bytes):
        return redact_url(value).encode("utf-8", "surrogateescape")
    return value


def safe_repr(value: Any) -> str:
    """``repr(value)`` with every secret hidden, for a message that shows a setting."""
    return scrub(repr(redacted(value)), value)


def scrub(text: str, *sources: Any) -> str:
    """``text`` with the secrets of ``sources`` (URLs, options dicts, settings) replaced by
    ``***``, and the pieces a parser may quote from them."""
    for secret in sorted(set(_secrets(sources)), key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text


def _secrets(sources: Iterable[Any]) -> Iterable[str]:
    for source in sources:
        if isinstance(source, Mapping):
            for key, item in source.items():
                if is_secret_key(key) and isinstance(item, str | bytes | int):
                    yield from _pieces(_text(item) if isinstance(item, str | bytes) else str(item))
                else:
                    yield from _secrets([key, item])
        elif isinstance(source, list | tuple):
            yield from _secrets(source)
        elif isinstance(source, str | bytes):
            yield from _url_secrets(_text(source))


def _url_secrets(url: str) -> Iterable[str]:
    """The passwords in ``url`` and the pieces of them a URL parser may quote."""
    for chunk in url.split(";") if url.lower().startswith("sentinel://") else [url]:
        scheme = _SCHEME.match(chunk)
        userinfo, at, _ = chunk[scheme.end() if scheme else 0 :].rpartition("@")
        if at and ":" in userinfo:
            yield from _pieces(userinfo.split(":", 1)[1])
        elif at and ("/" in userinfo or not scheme):
            yield from _pieces(userinfo)
    for match in _SECRET_IN_QUERY.finditer(url):
        yield from _pieces(match.group(1))


def _pieces(secret: str) -> Iterable[str]:
    for piece in [secret, *_SEPARATORS.split(secret)]:
        if len(piece) >= _MIN_PIECE:
            yield piece
