"""Decoration-time checks and naming by argument name (no worker needed)."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from typing import Any

import pytest
from celery import Celery, Task

from celery_redsem import ConfigurationError, KeyFunctionError, with_lock, with_semaphore
from celery_redsem.integration.guards.base import guards_of


def buy_item(self: Any, account_id: int, item_id: int, qty: int = 1) -> None:
    """A task body."""


@pytest.mark.parametrize("limit", [0, -1, True, 2.5, "3", None, 10**30])
def test_a_wrong_limit_fails_at_decoration(limit: object) -> None:
    with pytest.raises(ConfigurationError, match="limit of buy_item"):
        with_semaphore(limit, key="k")(buy_item)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        (lambda acount_id: acount_id, "asks for 'acount_id', which is not a parameter"),
        (lambda acount_id=None: f"{acount_id}", "takes none of the task's arguments"),
        (lambda *a: f"acct:{a[0]}", "takes none of the task's arguments"),
        (lambda account_id="zz", /: account_id, "takes none of the task's arguments"),
        (lambda acct, /: acct, "'acct' is positional-only"),
        ("a{b}", "must not contain"),
        ("", "must not be empty"),
        (42, "must be a str or a callable"),
    ],
)
def test_a_wrong_key_fails_at_decoration(key: object, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        with_semaphore(2, key=key)(buy_item)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value"),
    [("lease", 0), ("lease", 1e16), ("max_wait", -1), ("lost_lease_policy", "panic")],
)
def test_wrong_options_fail_at_decoration(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=option):
        with_lock("k", **{option: value})(buy_item)  # type: ignore[arg-type]


@pytest.mark.parametrize("finalized", [False, True])
def test_a_guard_above_app_task_fails_at_decoration(finalized: bool) -> None:
    # Above @app.task it would guard only the module attribute, never the registered task.
    # app.task gives a pending Proxy before the app is finalized, a Task after.
    app = Celery(set_as_current=False)
    if finalized:
        app.finalize()
    with pytest.raises(ConfigurationError, match=r"above @app\.task"):

        @with_lock(key="k")
        @app.task(shared=False)
        def build(report_id: int) -> None: ...

    assert app.finalized is finalized  # a pending task (a Proxy) was not evaluated to check


def test_wrapper_keeps_the_function_identity_and_carries_its_guard() -> None:
    wrapped = with_semaphore(5, key=lambda account_id: f"market:{account_id}")(buy_item)
    assert wrapped.__name__ == "buy_item"
    assert wrapped.__doc__ == "A task body."
    assert wrapped.__wrapped__ is buy_item  # type: ignore[attr-defined]
    (guard,) = guards_of(type("T", (), {"run": staticmethod(wrapped)})())
    assert guard.limit == 5


def test_key_receives_arguments_by_name_however_they_were_passed() -> None:
    (guard,) = guards_of(
        type(
            "T",
            (),
            {
                "run": staticmethod(
                    with_semaphore(
                        5, key=lambda item_id, account_id, qty: f"{account_id}/{item_id}/{qty}"
                    )(buy_item)
                )
            },
        )()
    )
    assert guard.name_for("t", (None, 1, 2), {}) == "1/2/1"  # defaults too
    assert guard.name_for("t", (None,), {"item_id": 2, "account_id": 1, "qty": 3}) == "1/2/3"
    stacked = with_lock("global")(functools.partial(buy_item))  # any callable with a signature
    assert stacked.__redsem_guard__.name_for("t", (None, 1, 2), {}) == "global"  # type: ignore[attr-defined]


def test_key_with_kwargs_gets_everything() -> None:
    wrapped = with_semaphore(2, key=lambda **kw: f"{kw['account_id']}")(buy_item)
    guard = wrapped.__redsem_guard__  # type: ignore[attr-defined]
    assert guard.name_for("t", (None, 7, 8), {}) == "7"
    with pytest.raises(KeyFunctionError, match="returned None"):
        with_semaphore(2, key=lambda account_id: None)(buy_item).__redsem_guard__.name_for(
            "t", (None, 1, 2), {}
        )  # type: ignore[attr-defined]


def _make_key(account_id: int, prefix: str) -> str:
    return f"{prefix}:{account_id}"


def _any_key(*args: Any, **kwargs: Any) -> str:
    return f"acct:{kwargs['account_id']}"


REGION = "eu"


@pytest.mark.parametrize(
    ("key", "name"),
    [
        (functools.partial(_make_key, prefix="acct"), "acct:7"),
        (lambda account_id, region=REGION: f"{region}:{account_id}", "eu:7"),  # captured value
        (_any_key, "acct:7"),
        (lambda account_id, *rest: f"acct:{account_id}", "acct:7"),
        (lambda: "everyone", "everyone"),  # no parameters: one name on purpose
    ],
)
def test_key_functions_the_task_can_fill_are_accepted(key: Any, name: str) -> None:
    guard = with_semaphore(2, key=key)(buy_item).__redsem_guard__  # type: ignore[attr-defined]
    assert guard.name_for("t", (None, 7, 8), {}) == name


def test_celery_checks_the_arguments_of_a_guarded_task_when_it_is_sent() -> None:
    # Task.typing: a call that does not fit the signature fails at send time, before any
    # broker is contacted, as it would without the guard.
    app = Celery(set_as_current=False, broker="memory://")

    @app.task(shared=False)
    @with_lock(key=lambda report_id: f"report:{report_id}")
    def build(report_id: int, pages: int) -> None: ...

    with pytest.raises(TypeError, match="pages"):
        build.apply_async(args=(1,))
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        build.apply_async(args=(1, 2), kwargs={"colour": "red"})


def test_arguments_that_do_not_fit_name_the_task_when_the_key_is_worked_out() -> None:
    (guard,) = guards_of(
        type("T", (), {"run": staticmethod(with_lock(key=lambda item_id: "k")(buy_item))})()
    )
    with pytest.raises(TypeError, match=r"task shop\.buy was called with arguments .*buy_item"):
        guard.name_for("shop.buy", (None, 1), {})


def _report(report_id: int) -> None: ...


@pytest.mark.parametrize(
    ("fn", "args", "hint"),
    [
        (buy_item, (1, 2), r"missing .*'item_id'; .* takes self needs @app\.task\(bind=True\)"),
        (_report, (Task(), 7), r"too many .*; with @app\.task\(bind=True\) .* take self first"),
    ],
)
def test_a_call_that_does_not_fit_hints_at_bind(fn: Any, args: tuple[Any, ...], hint: str) -> None:
    # bind=True forgotten for a function that takes self, or given for one that does not.
    guard = with_lock(key=lambda **kw: "k")(fn).__redsem_guard__  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=hint):
        guard.name_for("shop.t", args, {})
    # Other misfits get no such hint: one argument too many or too few on its own.
    for misfit in [(1, 2, 3, 4, 5), ()]:
        with pytest.raises(TypeError) as fits:
            guard.name_for("shop.t", misfit, {})
        assert "bind=True" not in str(fits.value)


BARE = r"without its arguments, so the task is the bare decorator"


@pytest.mark.parametrize("decorator", [with_lock, functools.partial(with_semaphore, 2)])
@pytest.mark.parametrize("options", [{}, {"shared": False, "name": "t.build"}, {"bind": True}])
def test_a_guard_written_without_its_arguments_fails_where_the_task_is_made(
    decorator: Any, options: dict[str, Any]
) -> None:
    # ``@with_lock`` with no parentheses takes the function as its key and returns the bare
    # decorator, which @app.task would register as the task (under the decorator's own name).
    app = Celery(set_as_current=False)
    with pytest.raises(ConfigurationError, match=BARE):

        @app.task(**options)
        @decorator
        def build(report_id: int) -> None: ...


SHARED_BARE = """
from celery import Celery, shared_task
from celery_redsem import with_lock

@shared_task
@with_lock
def build(report_id): ...

print("imported")
Celery(set_as_current=False).finalize()
"""


def test_a_bare_guard_under_shared_task_fails_when_an_app_is_finalized() -> None:
    # In a process of its own: shared_task registers the function with every app to come
    # before it fails, and each later finalize would fail again.
    done = subprocess.run(
        [sys.executable, "-c", SHARED_BARE], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert done.stdout.strip() == "imported"
    assert re.search(BARE, done.stderr), done.stderr


@pytest.mark.parametrize("decorator", [with_lock, functools.partial(with_semaphore, 2)])
def test_a_bare_guard_called_as_a_task_body_says_what_happened(decorator: Any) -> None:
    @decorator
    def build(report_id: int) -> None: ...

    with pytest.raises(ConfigurationError, match=BARE):
        build(7)  # as a task made of it would call it
    with pytest.raises(ConfigurationError, match=BARE):
        build(report_id=7)


HOOKS = """
import sys
from celery.signals import task_revoked, worker_init
import celery_redsem.integration.worker.hooks as worker

def ours(signal):
    return sum(1 for (uid, _), _r in signal.receivers if "celery_redsem" in str(uid))

assert (ours(worker_init), ours(task_revoked)) == (0, 0), "connected at import"
from celery_redsem import with_lock
for key in ("a", "b"):
    with_lock(key=key)(lambda: None)
print(ours(worker_init), ours(task_revoked))
"""


def test_the_worker_hooks_are_installed_by_the_decorators_once_not_by_an_import() -> None:
    # The decorators connect worker_init once; the worker connects the rest as it starts.
    done = subprocess.run(
        [sys.executable, "-c", HOOKS], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "0"]
