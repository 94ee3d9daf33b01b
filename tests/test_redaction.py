"""The one redactor: URLs, options dicts and any shown value lose their secrets, nothing else."""

from __future__ import annotations

import pytest

from celery_redsem.core.redaction import redact_url, redacted, safe_repr, scrub

PW = "S3cr3t-7Qx"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f":{PW}@host/0", ":***@host/0"),
        (f"{PW}@host:6379", "***@host:6379"),
        (f"app:{PW}@host/0", "app:***@host/0"),
        (f"redis://app:{PW}@h/0?ssl_password={PW}&db=1", "redis://app:***@h/0?ssl_password=***&db=1"),
        (f"redis://h/0?Password={PW}", "redis://h/0?Password=***"),
        (f"redis://app:a://b@{PW}@h/0", "redis://app:***@h/0"),
        (f":pa://{PW}@h/0", ":***@h/0"),
        ("redis://app@h:6379/0", "redis://app@h:6379/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("", ""),
    ],
)  # fmt: skip
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert redact_url(url.encode()) == shown


def test_options_keep_usernames_and_lose_every_secret():
    options = {
        "username": "app",
        "password": PW,
        "ssl_password": PW,
        "socket_timeout": "5",
        "sentinel_kwargs": {"username": "sentinel", "password": PW, "nested": {"auth_token": PW}},
        "credential_provider": object(),
        1: b"one",
        b"password": PW,
        "password_unset": None,
        "startup": [f"redis://:{PW}@a/0", (f"b:{PW}@c",)],
    }
    shown = redacted(options)
    assert shown["username"] == "app"
    assert shown["socket_timeout"] == "5"
    assert shown["sentinel_kwargs"] == {
        "username": "sentinel",
        "password": "***",
        "nested": {"auth_token": "***"},
    }
    assert shown["credential_provider"] == "***"
    assert shown[b"password"] == "***"
    assert shown["password_unset"] is None
    assert shown["startup"] == ["redis://:***@a/0", ("b:***@c",)]
    assert PW not in repr(shown)
    assert PW not in safe_repr(options)
    assert options["password"] == PW  # the original is left as it was
    assert shown[1] == b"one"


def test_safe_repr_of_plain_values_is_repr():
    assert safe_repr(5) == "5"
    assert safe_repr("redis://h/0") == "'redis://h/0'"
    assert safe_repr(None) == "None"
    assert safe_repr(f"redis://:{PW}@h/0".encode()) == "b'redis://:***@h/0'"


def test_scrub_removes_secrets_and_their_pieces_from_foreign_text():
    url = "redis://app:ab/cdef?ghij@h/0"
    text = "cannot parse 'ab/cdef?ghij' (near 'cdef', 'ghij')"
    assert scrub(text, url) == "cannot parse '***' (near '***', '***')"
    assert scrub(f"denied for {PW}", {"sentinel_kwargs": {"password": PW}}) == "denied for ***"
    assert scrub("port 123456 refused", {"password": 123456}) == "port *** refused"
    assert scrub("nothing secret", "redis://h/0", {"db": 1}) == "nothing secret"
