"""ACL users with the documented minimal rule, passwords kept out of messages, and TLS."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_redsem import FairSemaphore, Lock, Permit, Waiting, read_state, refresh_permits
from celery_redsem.core.clients import client_from_url, redact_url
from celery_redsem.core.errors import BackendError, ConfigurationError, NotEnoughReplicas
from celery_redsem.integration.settings import reset
from celery_redsem.ops.admin import force_release, purge, states
from celery_redsem.ops.cli import redsem
from tests.scale.acl import LUA, PASSWORD, create_user, documented_acl_rule
from tests.servers import ServerProcess, server_process, tls_redis, tls_unavailable_reason


@pytest.fixture
def private_server() -> Iterator[ServerProcess]:
    """A server of this test alone: ACL users are server-wide."""
    with server_process(tag="acl") as server:
        yield server


def test_the_documented_rule_allows_every_command_the_scripts_call():
    allowed = {w[1:].lower() for w in documented_acl_rule().split() if w.startswith("+")}
    called = set()
    for path in LUA.glob("*.lua"):
        called |= {
            c.lower() for c in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", path.read_text())
        }
    assert called, "no redis.call found: the scan is broken"
    assert called - allowed == set(), "add these to the ACL rule in docs/scaling.rst"


def test_a_user_with_only_the_documented_rule_can_run_everything(private_server, prefix):
    admin = private_server.client()
    create_user(admin, prefix, "redsem-app")
    url = f"redis://redsem-app:{PASSWORD}@127.0.0.1:{private_server.port}/0"
    client = client_from_url(url, socket_timeout=5)
    try:
        _exercise_everything(client, prefix)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("somebody-else:key", 1)
        other = FairSemaphore(client, "x", 1, prefix=f"not-{prefix}")
        with pytest.raises(BackendError, match=r"(?i)no permissions"):
            other.acquire()
    finally:
        client.close()
        admin.close()


def _exercise_everything(client: redis.Redis, prefix: str) -> None:
    sem = FairSemaphore(client, "market:1", 2, lease=30, prefix=prefix)
    first = sem.acquire(permit_id="task-1")
    second = sem.acquire(permit_id="task-2")
    assert isinstance(first, Permit)
    assert isinstance(second, Permit)
    assert sem.attempt("task-3", join_line=True).position == 1  # type: ignore[union-attr]
    got: list[Permit | None] = []
    waiter = threading.Thread(
        target=lambda: got.append(sem.acquire(blocking=True, timeout=10, permit_id="task-3"))
    )
    waiter.start()
    assert sem.release(first)
    waiter.join(10)
    assert isinstance(got[0], Permit)
    result = refresh_permits(client, [second, got[0]])
    assert len(result.refreshed) == 2
    assert [h.permit_id for h in read_state(client, "market:1", prefix=prefix).holders]
    found, total = states(client, prefix=prefix)
    assert total == 1
    assert found[0].name == "market:1"
    assert force_release(client, "market:1", "task-2", prefix=prefix).released == "holder"
    fair = FairSemaphore(client, "fair", 1, lease=30, prefix=prefix, grouped=True, group_limit=1)
    held = fair.attempt("f-1", group="a")
    assert isinstance(held, Permit)
    assert isinstance(fair.attempt("f-2", join_line=True, group="b"), Waiting)
    assert [g.group for g in fair.groups()] == ["b", "a"]
    assert refresh_permits(client, [held]).refreshed
    assert fair.release(held)
    assert isinstance(fair.attempt("f-2", join_line=True, group="b"), Permit)
    # A Celery worker's channel for offers (worker/fair_wakes.py), and an offer on it.
    offers = client.pubsub()
    channel = f"{prefix}:offers:worker-1"
    offers.subscribe(channel)
    assert offers.get_message(timeout=5)["type"] == "subscribe"
    assert isinstance(
        fair.attempt("f-3", join_line=True, group="c", back_in=20, waiter_lease=30, notify=channel),
        Waiting,
    )
    assert fair.release("f-2")
    assert offers.get_message(timeout=5)["data"] == b"f-3"
    offers.close()
    acked = Lock(client, "acked", prefix=prefix, min_replicas=1, replica_timeout=0.05)
    with pytest.raises(NotEnoughReplicas):  # WAIT and INFO allowed: the clear error, not NOPERM
        acked.acquire()
    assert purge(client, prefix=prefix) >= 1


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://app:{PASSWORD}@h:6379/0", "redis://app:***@h:6379/0"),
        (f"redis://:{PASSWORD}@h/0", "redis://:***@h/0"),
        (f"rediss://app:{PASSWORD}@h:6380/0?ssl_ca_certs=/ca", "rediss://app:***@h:6380/0?ssl_ca_certs=/ca"),
        (f"redis://h:6379/0?password={PASSWORD}&db=1", "redis://h:6379/0?password=***&db=1"),
        (f"redis+cluster://app:{PASSWORD}@a:1,b:2,c:3", "redis+cluster://app:***@a:1,b:2,c:3"),
        (
            f"sentinel://:{PASSWORD}@s1:26379/0;sentinel://:{PASSWORD}@s2:26379/0",
            "sentinel://:***@s1:26379/0;sentinel://:***@s2:26379/0",
        ),
        ("redis://app@h:6379/0", "redis://app@h:6379/0"),
        ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
    ],
)  # fmt: skip
def test_redact_url_hides_every_password(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("secret", ["s3cr/et-pw", "pa?ss#wo;rd", "we@ird:qzx9", "x/y?z#w"])
def test_passwords_with_url_characters_stay_hidden(secret):
    url = f"redis://app:{secret}@127.0.0.1:6379/0"
    assert secret not in redact_url(url)
    pieces = [p for p in re.split(r"[/?#;@:]", secret) if len(p) >= 3]
    shown = [redact_url(url)]
    try:
        client_from_url(url).close()
    except (ConfigurationError, BackendError) as exc:
        shown.append(str(exc))
    for text in shown:
        assert secret not in text
        assert not [p for p in pieces if p in text.replace("127.0.0.1", "")]
    obj = CLIContext(
        app=Celery("redsem-pw", broker="memory://", set_as_current=False),
        no_color=True,
        workdir=None,
    )
    result = CliRunner().invoke(redsem, ["--url", url, "status"], obj=obj)
    assert not [p for p in pieces if p in result.output]


def test_passwords_stay_out_of_errors_reprs_logs_and_the_cli(private_server, prefix, caplog):
    admin = private_server.client()
    create_user(admin, prefix, "redsem-app")
    admin.close()
    caplog.set_level(logging.DEBUG)
    messages: list[str] = []

    wrong = f"redis://redsem-app:{PASSWORD}x@127.0.0.1:{private_server.port}/0"
    client = client_from_url(wrong, socket_timeout=2)
    messages.append(repr(client))
    with pytest.raises(BackendError) as info:
        Lock(client, "job", prefix=prefix).acquire()
    messages += [str(info.value), repr(info.value), repr(info.value.__cause__)]
    client.close()

    unreachable = client_from_url(f"redis://redsem-app:{PASSWORD}@127.0.0.1:1/0", socket_timeout=1)
    with pytest.raises(BackendError) as info:
        Lock(unreachable, "job", prefix=prefix).acquire()
    messages += [str(info.value), repr(info.value.__cause__)]
    for bad in (f"foo://u:{PASSWORD}@h", f"redis+cluster://u:{PASSWORD}@h:1/3"):
        with pytest.raises(ConfigurationError) as config_info:
            client_from_url(bad)
        messages.append(str(config_info.value))
    with pytest.raises(ConfigurationError) as config_info:
        client_from_url(f"sentinel://u:{PASSWORD}@h:26379")
    messages.append(str(config_info.value))

    app = Celery("redsem-secret-cli", broker="memory://", set_as_current=False)
    app.conf.redsem_redis_url = wrong
    app.conf.redsem_key_prefix = prefix
    try:
        obj = CLIContext(app=app, no_color=True, workdir=None)
        result = CliRunner().invoke(redsem, ["status"], obj=obj)
        messages.append(result.output)
        assert result.exit_code != 0
        result = CliRunner().invoke(redsem, ["--url", wrong, "inspect", "job"], obj=obj)
        messages.append(result.output)
    finally:
        reset(app)
    messages += [record.getMessage() for record in caplog.records]
    leaked = [m for m in messages if PASSWORD in m]
    assert leaked == []
    assert any("WRONGPASS" in m or "invalid username-password" in m for m in messages)


@pytest.fixture(scope="module")
def tls_server() -> Iterator[object]:
    reason = tls_unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        with tls_redis() as server:
            yield server
    except RuntimeError as exc:  # the binary exists but was built without TLS
        pytest.skip(f"redis-server cannot serve TLS here: {str(exc).splitlines()[0]}")


@pytest.mark.parametrize(
    ("query", "cert_reqs"),
    [
        ("ssl_cert_reqs=CERT_REQUIRED", "required"),  # Celery's spelling
        ("ssl_cert_reqs=CERT_NONE&ssl_ca_certs=/ca", "none"),
        ("ssl_ca_certs=/ca&ssl_cert_reqs=optional", "optional"),  # redis-py's
    ],
)
def test_ssl_cert_reqs_in_celery_or_redis_py_spelling(query, cert_reqs):
    client = client_from_url(f"rediss://h:6380/0?{query}")  # builds, does not connect
    assert client.connection_pool.connection_kwargs["ssl_cert_reqs"] == cert_reqs
    client.close()


def test_rediss_url_with_an_acl_user_over_tls(tls_server, prefix):
    server = tls_server.server  # type: ignore[attr-defined]
    admin = redis.Redis(
        host="127.0.0.1",
        port=server.port,
        ssl=True,
        ssl_ca_certs=str(tls_server.ca_file),  # type: ignore[attr-defined]
    )
    create_user(admin, prefix, "redsem-tls")
    admin.close()
    url = (
        f"rediss://redsem-tls:{PASSWORD}@127.0.0.1:{server.port}/0"
        f"?ssl_ca_certs={tls_server.ca_file}"  # type: ignore[attr-defined]
        "&ssl_cert_reqs=CERT_REQUIRED"  # as Celery's docs write it
    )
    client = client_from_url(url, socket_timeout=5)
    try:
        assert isinstance(client.connection_pool.connection_class(), redis.SSLConnection)
        assert client.connection_pool.connection_kwargs["ssl_cert_reqs"] == "required"
        _exercise_everything(client, prefix)
    finally:
        client.close()
    plain = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.5, retry=None)
    with pytest.raises(redis.ConnectionError):
        plain.ping()  # TLS only: a plain-text client gets nowhere
    plain.close()
