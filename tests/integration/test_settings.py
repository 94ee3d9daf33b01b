"""Settings read from app.conf (plain and Django-namespaced), per-app caching, fork-safe clients."""

from __future__ import annotations

import dataclasses

import pytest
from celery import Celery, _state, current_app
from celery.local import Proxy

from celery_redsem import ConfigurationError, RedsemConfig, get_client, get_config, with_lock
from celery_redsem.integration.guards.base import iter_guarded_tasks
from celery_redsem.integration.settings import SETTINGS, reset
from celery_redsem.integration.worker.start_checks import check_task_leases, start_warnings
from tests.integration.conftest import true_in_forked_child


def _app(**conf: object) -> Celery:
    app = Celery("cfgtest", set_as_current=False)
    app.conf.update(conf)
    return app


def test_defaults_match_the_settings_table() -> None:
    # One source: the config's fields have no defaults of their own, one per setting.
    fields = {f.name: f for f in dataclasses.fields(RedsemConfig)}
    assert {f"redsem_{name}" for name in fields} - {"redsem_redis_url_source"} == {
        s.name for s in SETTINGS
    }
    assert all(f.default is dataclasses.MISSING for f in fields.values())
    config = RedsemConfig.from_conf({})
    for setting in SETTINGS:
        attr = setting.name.removeprefix("redsem_")
        if attr in ("redis_url", "redis_options"):
            continue
        assert getattr(config, attr) == setting.default, setting.name
    assert len({s.name for s in SETTINGS}) == len(SETTINGS)


def test_django_namespace_is_read_through_app_conf() -> None:
    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_REDSEM_REDIS_URL = "redis://example:6379/3"
        CELERY_REDSEM_LEASE = 4
        CELERY_REDSEM_MAX_WAIT = None
        CELERY_REDSEM_LOST_LEASE_POLICY = "raise"

    app = Celery("djangolike", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    config = get_config(app)
    assert config.redis_url == "redis://example:6379/3"
    assert config.lease == 4.0
    assert config.max_wait is None
    assert config.lost_lease_policy == "raise"


def test_url_falls_back_to_a_redis_result_backend_then_broker() -> None:
    assert (
        get_config(_app(result_backend="rediss://h:1/2", broker_url="redis://b/0")).redis_url
        == "rediss://h:1/2"
    )
    config = get_config(_app(result_backend="rpc://", broker_url="redis://b:1/0;redis://c:1/0"))
    assert (config.redis_url, config.redis_url_source) == ("redis://b:1/0", "broker_url")


def test_no_redis_anywhere_is_a_clear_error_at_first_use() -> None:
    app = _app(broker_url="amqp://guest@localhost//", result_backend="rpc://")
    assert get_config(app).redis_url is None  # reading the config does not fail ...
    with pytest.raises(ConfigurationError, match="redsem_redis_url"):
        get_client(app)  # ... using it does


@pytest.mark.parametrize(
    ("conf", "fragments"),
    [
        (  # redis-py would reject it only at the first command, in a task
            {"redsem_redis_options": {"socket_timout": 1.0}},
            ["redsem_redis_options ['socket_timout']", "unexpected keyword argument"],
        ),
        (
            {"redsem_redis_url": "rediss://h:1/0?ssl_cert_reqs=always"},
            ["(from redsem_redis_url)", "Invalid SSL Certificate Requirements Flag"],
        ),
        (
            {"redsem_redis_url": "localhost:6379"},
            ["for 'localhost:6379' (from redsem_redis_url): ", "has no scheme"],
        ),
    ],
)
def test_a_client_option_or_url_redis_py_rejects_fails_before_any_task(
    conf: dict[str, object], fragments: list[str]
) -> None:
    with pytest.raises(ConfigurationError) as info:
        get_client(_app(broker_url="memory://", **{"redsem_redis_url": "redis://h:1/0", **conf}))
    for fragment in fragments:
        assert fragment in str(info.value)
    if "redsem_redis_options" not in conf:  # the defaults have nothing to do with it
        assert "socket_connect_timeout" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("redsem_lease", "ten", "number of seconds > 0"),
        ("redsem_lease", 0, "number of seconds > 0"),
        ("redsem_max_wait", -1, "or None"),
        ("redsem_retry_jitter", "yes", "True or False"),
        ("redsem_lost_lease_policy", "panic", "one of 'log', 'raise'"),
        ("redsem_lease", 1e16, "<= 31536000"),  # one rule with the core: bounded
        ("redsem_redis_options", ["socket_timeout"], "dict"),
        ("redsem_redis_options", {"socket_timeout": "5"}, "'socket_timeout' is a number"),
        ("redsem_redis_options", {"socket_connect_timeout": 0}, "'socket_connect_timeout'"),
        ("redsem_redis_options", {"health_check_interval": True}, "'health_check_interval'"),
        ("redsem_redis_options", {"max_connections": 0.5}, "'max_connections' is an int"),
        ("redsem_redis_options", {"max_connections": True}, "'max_connections' is an int"),
        ("redsem_key_prefix", "a{b}", "non-empty str"),
        ("redsem_min_replicas", -1, "an int >= 0"),
        ("redsem_min_replicas", True, "an int >= 0"),
        ("redsem_min_replicas", 1.5, "an int >= 0"),
        ("redsem_replica_timeout", 0, "number of seconds > 0"),
    ],
)
def test_bad_settings_name_the_setting(name: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=f"setting {name} must be") as info:
        get_config(_app(**{name: value}))
    assert fragment in str(info.value)
    assert "CELERY_" not in str(info.value)  # not a Django app


def test_a_bad_django_setting_is_named_as_django_spells_it() -> None:
    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_REDSEM_LEASE = -1

    app = Celery("django-like", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match=r"setting CELERY_REDSEM_LEASE \(redsem_lease\)"):
        get_config(app)


def test_config_and_client_are_per_app(redis_url: str) -> None:
    one, two = (
        _app(redsem_redis_url=redis_url, redsem_lease=1),
        _app(redsem_redis_url=redis_url, redsem_lease=2),
    )
    assert get_config(one) is get_config(one)
    assert (get_config(one).lease, get_config(two).lease) == (1.0, 2.0)
    assert get_client(one) is get_client(one)
    assert get_client(one) is not get_client(two)


def test_a_forked_child_builds_its_own_client(redis_url: str) -> None:
    app = _app(redsem_redis_url=redis_url)
    parent_client = get_client(app)
    assert parent_client.ping()

    def child_has_its_own_working_client() -> bool:
        child_client = get_client(app)
        return child_client is not parent_client and bool(child_client.ping())

    assert true_in_forked_child(child_has_its_own_working_client)
    assert get_client(app) is parent_client
    assert parent_client.ping()


def test_celery_proxies_share_the_apps_config_and_client(redis_url: str) -> None:
    app = _app(redsem_redis_url=redis_url, redsem_lease=3)
    proxy = Proxy(lambda: app)
    assert get_config(proxy) is get_config(app)
    assert get_client(proxy) is get_client(app)
    previous = _state._tls.current_app
    app.set_current()
    try:
        assert get_config(current_app).lease == 3.0  # celery.current_app is a Proxy too
        assert get_client(current_app) is get_client(app)
        assert get_client(current_app).ping()
    finally:
        _state._tls.current_app = previous


@pytest.mark.parametrize(("lease", "warns"), [(1.0, True), (10.0, False)])
def test_a_socket_timeout_longer_than_a_heartbeat_interval_is_warned_about(
    lease: float, warns: bool
) -> None:
    # Warned at worker start (StartChecks), where the worker's logging shows it.
    app = Celery("redsem-stall", broker="memory://", set_as_current=False)
    app.conf.redsem_lease = lease  # the default socket_timeout is 2 s
    app.conf.redsem_check_eviction_policy = False

    @app.task(shared=False, name="t.guarded")
    @with_lock(key="k")
    def guarded() -> None: ...

    app.finalize()
    warnings = start_warnings(app)
    assert any("(redsem_lease=" in w and "heartbeat interval" in w for w in warnings) == warns


def test_a_task_lease_shorter_than_three_socket_timeouts_is_warned_about() -> None:
    app = Celery("redsem-task-lease", broker="memory://", set_as_current=False)

    @app.task(shared=False, name="t.short")
    @with_lock(key="short", lease=0.3)  # the default socket_timeout is 2 s
    def short() -> None: ...

    @app.task(shared=False, name="t.long")
    @with_lock(key="long", lease=30)
    def long() -> None: ...

    app.finalize()
    guarded = list(iter_guarded_tasks(app))
    (warning,) = check_task_leases(get_config(app), guarded)
    assert "t.short's lease=0.3s / 3" in warning
    app.conf.redsem_redis_options = {"socket_timeout": 0.05}
    reset(app)
    assert check_task_leases(get_config(app), guarded) == []


def test_a_misspelled_setting_is_warned_about_with_the_likely_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class DjangoSettings:
        CELERY_BROKER_URL = "redis://h/0"
        CELERY_REDSEM_LEESE = 5

    app = Celery("redsem-typo", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    app.conf.redsem_idle_tt = 3
    app.conf.redsem_lease = 30.0  # a real one: no warning
    caplog.set_level("WARNING", logger="celery_redsem.integration.settings")
    get_config(app)
    warnings = sorted(r.getMessage() for r in caplog.records if "is not a" in r.getMessage())
    assert warnings == [
        "celery_redsem: CELERY_REDSEM_LEESE is not a celery_redsem setting and is ignored; "
        "did you mean CELERY_REDSEM_LEASE?",
        "celery_redsem: redsem_idle_tt is not a celery_redsem setting and is ignored; "
        "did you mean redsem_idle_ttl?",
    ]


def test_a_setting_spelled_so_that_celery_does_not_map_it_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Settings:
        REDSEM_MAX_WAIT = 10  # no CELERY_ prefix
        CELERY_REDSEM_LEASE = 20  # loaded below without namespace="CELERY"

    app = Celery("redsem-unread", set_as_current=False)
    app.config_from_object(Settings)
    caplog.set_level("WARNING", logger="celery_redsem.integration.settings")
    config = get_config(app)
    assert (config.lease, config.max_wait) == (10.0, 3600.0)  # neither was read ...
    warnings = sorted(r.getMessage() for r in caplog.records if "is not read" in r.getMessage())
    assert [w.split(";")[0] for w in warnings] == [  # ... and both are named
        "celery_redsem: CELERY_REDSEM_LEASE is not read",
        "celery_redsem: REDSEM_MAX_WAIT is not read",
    ]
