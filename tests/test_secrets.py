"""No password in any message: every place a password can be (a URL, str or bytes, with or
without a scheme; an options dict, nested or with odd keys; the CLI's --url) and every place
a message goes (exceptions, the command line's output, logs)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_redsem import ConfigurationError, RedsemConfig, get_client
from celery_redsem.core.clients import client_from_url
from celery_redsem.integration.settings import reset
from celery_redsem.ops.cli import redsem

PASSWORD = "S3cr3t-7Qx"

#: redis-py options a password can hide in, each with something that fails validation.
BAD_OPTIONS = [
    pytest.param({"password": PASSWORD, "socket_timeout": "5"}, "socket_timeout", id="str-timeout"),
    pytest.param({"password": PASSWORD, 1: "x"}, "redis-py keyword", id="non-str-key"),
    pytest.param(
        {"sentinel_kwargs": {"password": PASSWORD}, "socket_connect_timeout": "2"},
        "socket_connect_timeout",
        id="nested",
    ),
    pytest.param({"ssl_password": PASSWORD, "max_connections": 0}, "max_connections", id="ssl"),
    pytest.param({b"password": PASSWORD, "x": 1}, "redis-py keyword", id="bytes-key"),
]

BAD_URLS = [
    pytest.param(f":{PASSWORD}@host/0", "no scheme", id="no-scheme"),
    pytest.param(f"{PASSWORD}@host:6379", "no scheme", id="no-scheme-no-user"),
    pytest.param(f"app:{PASSWORD}@host:6379/0", "no scheme", id="no-scheme-user"),
    pytest.param(f"redis://h/0?password={PASSWORD}&bogus=1", "bogus", id="query"),
]


@pytest.fixture
def apps() -> Iterator[list[Celery]]:
    made: list[Celery] = []
    yield made
    for app in made:
        reset(app)


def _app(made: list[Celery], **conf: object) -> Celery:
    app = Celery("redsem-secrets", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    made.append(app)
    return app


def _cli(app: Celery, *args: str) -> str:
    obj = CLIContext(app=app, no_color=True, workdir=None)
    result = CliRunner().invoke(redsem, list(args), obj=obj)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    return result.output


def _no_password(*texts: str) -> None:
    leaked = [text for text in texts if PASSWORD in text]
    assert leaked == []


@pytest.mark.parametrize(("options", "named"), BAD_OPTIONS)
def test_a_bad_options_dict_is_shown_without_its_password(apps, options, named):
    with pytest.raises(ConfigurationError) as info:
        RedsemConfig.from_conf({"redsem_redis_options": options})
    message = str(info.value)
    assert "redsem_redis_options" in message
    assert named in message
    assert "***" in message
    app = _app(apps, redsem_redis_url="redis://127.0.0.1:1/0", redsem_redis_options=options)
    _no_password(message, repr(info.value), _cli(app, "status"))


@pytest.mark.parametrize(("url", "named"), BAD_URLS)
def test_a_bad_url_is_shown_without_its_password(apps, url, named):
    with pytest.raises(ConfigurationError) as info:
        client_from_url(url)
    assert named in str(info.value)
    app = _app(apps, redsem_redis_url=url)
    with pytest.raises(ConfigurationError) as from_app:
        get_client(app)
    assert named in str(from_app.value)
    other = _app(apps, redsem_redis_url="redis://127.0.0.1:1/0")
    shown = [str(info.value), str(from_app.value), _cli(app, "status")]
    shown.append(_cli(other, "--url", url, "status"))
    assert all("***" in text for text in shown)
    _no_password(*shown)


def test_a_bytes_url_is_shown_without_its_password(apps):
    url = f"redis://app:{PASSWORD}@127.0.0.1:1/0".encode()
    with pytest.raises(ConfigurationError) as info:
        client_from_url(url)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError) as from_conf:
        RedsemConfig.from_conf({"redsem_redis_url": url})
    app = _app(apps, redsem_redis_url=url)
    shown = [str(info.value), str(from_conf.value), _cli(app, "status")]
    assert all("app:***@" in text for text in shown)
    _no_password(*shown)


def test_options_that_redis_py_refuses_keep_their_password_hidden(apps):
    options = {"password": PASSWORD, "no_such_option": PASSWORD}
    app = _app(apps, redsem_redis_url="redis://127.0.0.1:1/0", redsem_redis_options=options)
    with pytest.raises(ConfigurationError) as info:
        get_client(app)
    assert "no_such_option" in str(info.value)
    _no_password(str(info.value), _cli(app, "status"))


def test_no_password_reaches_the_log_of_a_failing_cli_call(apps, caplog):
    caplog.set_level(logging.DEBUG)
    options = {"password": PASSWORD, "socket_timeout": "5"}
    app = _app(apps, redsem_redis_url="redis://127.0.0.1:1/0", redsem_redis_options=options)
    out = _cli(app, "--url", f"redis://:{PASSWORD}@127.0.0.1:1/0", "status")
    _no_password(out, caplog.text)
