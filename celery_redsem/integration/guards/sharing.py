"""Who shares a semaphore: ``fair_by``, ``weight`` and ``group_limit`` of ``@with_semaphore``.

With ``fair_by`` the task's semaphore is grouped (:mod:`~celery_redsem.core.fair_share`): a free
permit goes to the group (say, the account) with the smallest share served, FIFO within a
group. :class:`Sharing` checks the options when the decorator is applied and works out one
call's group and weight: ``fair_by`` and a ``weight`` function get the task's arguments by name,
as a key function does (:class:`~celery_redsem.integration.guards.naming.ByName`), and whatever
they raise or return that is no group or weight becomes a
:class:`~celery_redsem.KeyFunctionError` naming the task: the run fails visibly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from celery_redsem.core.errors import ConfigurationError
from celery_redsem.core.fair_share import GROUP_LIMIT, FairShare
from celery_redsem.integration.guards.naming import ByName

__all__ = ["Share", "Sharing", "fair_settings", "share_of", "sharing_of"]

#: One call's group and weight.
Share = tuple[str, float]


class Sharing:
    """The ``fair_by``, ``weight`` and ``group_limit`` of one decorated task function
    (``where`` names it in messages)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        fair_by: Callable[..., object],
        weight: float | Callable[..., object],
        group_limit: int | None,
        where: str,
    ) -> None:
        if not callable(fair_by):
            raise ConfigurationError(
                f"fair_by of {where} must be a callable of the task's arguments by name "
                f"(fair_by=lambda account_id: account_id), got {fair_by!r}"
            )
        instead = "leave fair_by out for one line in arrival order"
        self._fair_by = ByName(fn, fair_by, "fair_by", where, instead)
        self._check = FairShare(True, None, name=where)  # the group and weight rules
        self._weight: ByName | None = None
        self._fixed_weight = 1.0
        if callable(weight) and not isinstance(weight, int | float):
            self._weight = ByName(fn, weight, "weight", where, "pass a number")
        else:
            try:
                self._check.group_arg("g", weight, where)
            except ConfigurationError as exc:
                raise ConfigurationError(f"weight of {where}: {exc}") from None
            self._fixed_weight = float(weight)
        self.group_limit: int | None = GROUP_LIMIT.check(group_limit, f"group_limit of {where}")

    def share_for(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Share:
        """The group and weight of one call (``args`` as the task function receives them)."""
        fair_by = self._fair_by
        group = fair_by(task_name, args, kwargs)
        if isinstance(group, int) and not isinstance(group, bool):
            group = str(group)
        if not isinstance(group, str):
            raise fair_by.error(
                task_name, f"returned {type(group).__name__} {group!r:.80}, not a str"
            )
        weight: object = self._fixed_weight
        if self._weight is not None:
            weight = self._weight(task_name, args, kwargs)
        try:
            self._check.group_arg(group, weight, task_name)
        except ConfigurationError as exc:
            culprit = fair_by if self._weight is None or "weight" not in str(exc) else self._weight
            raise culprit.error(task_name, f"returned an unusable value: {exc}") from None
        return group, float(weight)  # type: ignore[arg-type]


def sharing_of(fn: Callable[..., Any], options: Mapping[str, Any], where: str) -> Sharing | None:
    """The :class:`Sharing` of a decorated function with the decorator's ``options``, or None
    without ``fair_by`` (then ``weight`` and ``group_limit`` must be left out)."""
    fair_by, weight = options.get("fair_by"), options.get("weight", 1)
    group_limit = options.get("group_limit")
    if fair_by is not None:
        return Sharing(fn, fair_by, weight, group_limit, where)
    for what, value, default in (("weight", weight, 1), ("group_limit", group_limit, None)):
        if value != default or isinstance(value, bool):
            raise ConfigurationError(
                f"{what} of {where} applies to a fair share: pass fair_by= too "
                "(fair_by=lambda account_id: account_id)"
            )
    return None


def share_of(
    sharing: Sharing | None, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Share | None:
    """One call's group and weight, or None if the semaphore is not shared fairly."""
    return None if sharing is None else sharing.share_for(task_name, args, kwargs)


def fair_settings(sharing: Sharing | None) -> dict[str, Any]:
    """The semaphore settings that follow from ``sharing`` (``grouped``, ``group_limit``)."""
    return {"grouped": sharing is not None, "group_limit": sharing and sharing.group_limit}
