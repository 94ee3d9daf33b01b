"""``fair_by``, ``weight`` and ``group_limit`` of ``@with_semaphore``: checked at decoration,
and a call's group and weight worked out by argument name (no worker needed)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_redsem import ConfigurationError, KeyFunctionError, with_lock, with_semaphore
from celery_redsem.integration.guards.base import guards_of
from celery_redsem.integration.guards.semaphore_guard import SemaphoreGuard


def call_market(account_id: int, plan: str = "std") -> None:
    """A task body."""


def guard_of(fn: Any) -> SemaphoreGuard:
    (guard,) = guards_of(type("T", (), {"run": fn}), SemaphoreGuard)
    return guard


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"fair_by": "account"}, "fair_by of call_market must be a callable"),
        ({"fair_by": lambda acount_id: acount_id}, "asks for 'acount_id'"),
        ({"fair_by": lambda account_id: account_id, "weight": 0}, "weight of call_market"),
        ({"fair_by": lambda account_id: account_id, "weight": "2"}, "weight of call_market"),
        ({"fair_by": lambda account_id: account_id, "weight": lambda plna: 1}, "asks for 'plna'"),
        ({"fair_by": lambda account_id: account_id, "group_limit": 0}, "group_limit of"),
        ({"fair_by": lambda account_id: account_id, "group_limit": 2.5}, "group_limit of"),
        ({"weight": 2}, "weight of call_market applies to a fair share"),
        ({"group_limit": 2}, "group_limit of call_market applies to a fair share"),
    ],
)
def test_wrong_fair_share_options_fail_at_decoration(options: Any, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        with_semaphore(20, "market-api", **options)(call_market)


def test_a_call_gets_its_group_and_weight_by_argument_name() -> None:
    guard = guard_of(
        with_semaphore(
            20,
            "market-api",
            fair_by=lambda account_id: account_id,
            weight=lambda plan: 3 if plan == "pro" else 1,
            group_limit=5,
        )(call_market)
    )
    assert guard.sharing is not None
    assert guard.sharing.group_limit == 5
    assert guard.naming_for("t", (7,), {"plan": "pro"}) == ("market-api", 20, ("7", 3.0))
    assert guard.naming_for("t", (), {"account_id": "acme"})[2] == ("acme", 1.0)
    lock = guard_of(with_lock("report", fair_by=lambda account_id: account_id)(call_market))
    assert lock.naming_for("t", (1,), {}) == ("report", 1, ("1", 1.0))
    plain = guard_of(with_semaphore(2, "k")(call_market))
    assert plain.naming_for("t", (1,), {})[2] is None


@pytest.mark.parametrize(
    ("fair_by", "weight", "fragment"),
    [
        (lambda account_id: None, 1, "fair_by function .* of task t returned NoneType"),
        (lambda account_id: 1 / 0, 1, "fair_by function .* of task t raised ZeroDivisionError"),
        (lambda account_id: "", 1, "fair_by function .* returned an unusable value"),
        (lambda account_id: "a\0b", 1, "fair_by function .* returned an unusable value"),
        (lambda account_id: "a", lambda plan: -1, "weight function .* unusable value"),
        (lambda account_id: "a", lambda plan: None, "weight function .* unusable value"),
    ],
)
def test_a_bad_group_or_weight_of_a_call_is_a_key_function_error(
    fair_by: Any, weight: Any, fragment: str
) -> None:
    guard = guard_of(with_semaphore(2, "k", fair_by=fair_by, weight=weight)(call_market))
    with pytest.raises(KeyFunctionError, match=fragment):
        guard.naming_for("t", (1,), {})
