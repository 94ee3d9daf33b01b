"""The fast path that binds a task's arguments for its key function agrees with ``inspect``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from celery_redsem.core.errors import KeyFunctionError
from celery_redsem.integration.guards.naming import ByName, _SimpleBinding


def two(a: Any, b: Any) -> None: ...


def defaults(a: Any, b: Any = 2, *, c: Any, d: Any = 4) -> None: ...


def bound_task(self: Any, key: Any, sent: Any, seconds: Any, tag: str = "x") -> None: ...


CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}),
    ((1,), {}),
    ((1, 2), {}),
    ((1, 2, 3), {}),
    ((1, 2, 3, 4), {}),
    ((1, 2, 3, 4, 5), {}),
    ((1, 2, 3, 4, 5, 6), {}),
    ((1,), {"b": 2}),
    ((1,), {"a": 1}),  # a twice
    ((), {"a": 1, "b": 2}),
    ((1,), {"c": 3}),
    ((1, 2), {"c": 3, "d": 5}),
    ((1,), {"c": 3, "e": 5}),  # no parameter e
    ((1, 2), {"tag": "y"}),
    ((1, 2, 3, 4), {"tag": "y"}),
    ((1, 2, 3), {"seconds": 4}),
]


@pytest.mark.parametrize("fn", [two, defaults, bound_task])
@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_the_simple_binding_agrees_with_inspect(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    signature = inspect.signature(fn)
    binding = _SimpleBinding.of(signature)
    assert binding is not None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        assert binding.bind(args, kwargs) is None  # the general path says why
        return
    bound.apply_defaults()
    simple = binding.bind(args, kwargs)
    assert simple is not None
    assert list(simple.items()) == list(bound.arguments.items())  # in signature order too


def test_signatures_with_star_arguments_take_the_general_path() -> None:
    def star(a: Any, *args: Any, **kwargs: Any) -> None: ...

    def positional_only(a: Any, /, b: Any) -> None: ...

    assert _SimpleBinding.of(inspect.signature(star)) is None
    assert _SimpleBinding.of(inspect.signature(positional_only)) is None


def test_a_key_function_gets_the_same_arguments_either_way() -> None:
    key = ByName(defaults, lambda a, d, c=None: (a, c, d), "key", "defaults", "pass a str")
    assert key("t", (1,), {"c": 3}) == (1, 3, 4)
    with pytest.raises(TypeError, match="do not fit"):
        key("t", (1, 2, 3), {})
    broken = ByName(two, lambda a: 1 / 0, "key", "two", "pass a str")
    with pytest.raises(KeyFunctionError, match="ZeroDivisionError"):
        broken("t", (1, 2), {})
