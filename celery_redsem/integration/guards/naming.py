"""Naming a task run's semaphore: the key function (and a limit function), checked at
decoration, called with the task's arguments by name.

:class:`KeyNaming` checks a key function against the task function's signature when the
decorator is applied (a misspelt argument fails at import, not in a worker), and works out the
name for one call: a fixed str key, or what the key function returns for the arguments it
names. :class:`LimitRule` does the same for ``limit=``: a fixed int, or a limit function of the
arguments by name (both through :class:`ByName`). Whatever such a function raises,
:exc:`SystemExit` and :exc:`KeyboardInterrupt` included, becomes a
:class:`~celery_redsem.KeyFunctionError`: it runs in the worker's main process during
admission, where an escaping exit would stop the worker.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

from celery import Task

from celery_redsem.core.errors import ConfigurationError, KeyFunctionError
from celery_redsem.core.validation import LIMIT, Rule, validate_name

__all__ = [
    "ByName",
    "KeyFunction",
    "KeyNaming",
    "LimitFunction",
    "LimitRule",
    "call_arguments",
    "describe",
]

logger = logging.getLogger(__name__)

KeyFunction = Callable[..., object]
LimitFunction = Callable[..., object]

_NAMED_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
#: What a key function may raise that becomes a KeyFunctionError (exits included: see above).
_KEY_FUNCTION_FAILURES = (Exception, SystemExit, KeyboardInterrupt)


def describe(fn: object, signature: inspect.Signature | None = None) -> str:
    """``name(signature) (file:line)``, for messages (the signature only if given)."""
    code = getattr(fn, "__code__", None)
    name = (getattr(fn, "__qualname__", None) or repr(fn)) + (str(signature) if signature else "")
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _bind_hint(signature: inspect.Signature, args: tuple[Any, ...], kwargs: Any) -> str:
    """A hint for a call that fits but for the task itself as the first argument: a function
    that takes self on a task without ``bind=True``, or one that does not, on a bound task."""

    def fits(*args: Any) -> bool:
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            return False
        return True

    bound = bool(args) and isinstance(args[0], Task)  # a bound task's run gets the task first
    if not bound and next(iter(signature.parameters), None) == "self" and fits(None, *args):
        return "; a task function that takes self needs @app.task(bind=True)"
    if bound and fits(*args[1:]):
        return "; with @app.task(bind=True) the function must take self first"
    return ""


class _SimpleBinding:
    """Binds a call to a signature of plain parameters (no ``*args``, ``**kwargs`` or
    positional-only ones), as ``signature.bind`` then ``apply_defaults`` would, at a fraction
    of their cost: a key function runs on every dispatch and every task start."""

    def __init__(self, signature: inspect.Signature) -> None:
        params = signature.parameters.values()
        self._order = list(signature.parameters)
        self._positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        self._names = frozenset(self._order)
        self._required = [p.name for p in params if p.default is p.empty]
        self._defaults = {p.name: p.default for p in params if p.default is not p.empty}

    @classmethod
    def of(cls, signature: inspect.Signature) -> _SimpleBinding | None:
        """The binding for ``signature`` if its parameters are all plain, else None."""
        kinds = {p.kind for p in signature.parameters.values()}
        return cls(signature) if kinds <= set(_NAMED_KINDS) else None

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """Every parameter's value for the call, defaults included; None if the call does
        not fit (``signature.bind`` then says why)."""
        if len(args) > len(self._positional):
            return None
        named = dict(zip(self._positional, args, strict=False))
        for name, value in kwargs.items():
            if name in named or name not in self._names:
                return None
            named[name] = value
        if any(name not in named for name in self._required):
            return None
        defaults = self._defaults
        return {name: named[name] if name in named else defaults[name] for name in self._order}


def call_arguments(task: Task[Any, Any], args: Any) -> tuple[Any, ...]:
    """The positional arguments the task's function receives for a message's ``args``.

    With ``bind=True`` the function also receives the task. (``autoretry_for`` replaces
    ``run`` with a plain function and keeps the bound one as ``_orig_run``.)
    """
    call_args = tuple(args or ())
    if inspect.ismethod(getattr(task, "_orig_run", task.run)):
        call_args = (task, *call_args)
    return call_args


class ByName:
    """A function of a task's arguments by name (a key or a limit function), checked against
    the task function's ``signature`` when made; ``what`` (``"key"``, ``"limit"``) and
    ``where`` (the task function) name it in messages."""

    def __init__(
        self,
        fn: Callable[..., Any],
        func: Callable[..., object],
        what: str,
        where: str,
        instead: str,
    ) -> None:
        self.fn = fn
        self.func = func
        self.what = what
        self.signature = inspect.signature(fn)
        self._binding = _SimpleBinding.of(self.signature)
        self._names = self._check(where, instead)  # None: it takes **kwargs

    def _check(self, where: str, instead: str) -> list[str] | None:
        func, what = self.func, self.what
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"cannot inspect {what} function of {where}: {exc}") from None
        task_params = self.signature.parameters
        task_takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in task_params.values())
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return None  # it takes whatever it is given
        names: list[str] = []
        for p in params.values():
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                raise ConfigurationError(
                    f"{what} function {describe(func)} of {where}: parameter {p.name!r} is "
                    f"positional-only; the {what} receives the task's arguments by name"
                )
            if p.kind not in _NAMED_KINDS:
                continue  # *args, or positional-only with a default: never given a value
            if p.name not in task_params and not task_takes_kwargs and p.default is p.empty:
                raise ConfigurationError(
                    f"{what} function {describe(func)} of {where} asks for {p.name!r}, which is "
                    f"not a parameter of {where}{self.signature}"
                )
            names.append(p.name)
        receivable = [n for n in names if n in task_params or task_takes_kwargs]
        if params and not receivable:
            # Parameters, but none the task's arguments can fill (a misspelt name with a
            # default, only *args): every call would get the same answer.
            raise ConfigurationError(
                f"{what} function {describe(func)} of {where} takes none of the task's "
                f"arguments ({', '.join(params)} against {where}{self.signature}), so every "
                f"call would get the same {what}; name the arguments it uses ({what}=lambda "
                f"account_id: ...), or {instead}"
            )
        return names

    def __call__(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> object:
        """What the function returns for one call (``args`` as the task function receives
        them); whatever it raises becomes a :class:`~celery_redsem.KeyFunctionError`."""
        named = self._named_arguments(task_name, args, kwargs)
        try:
            return self.func(**named)
        except _KEY_FUNCTION_FAILURES as exc:
            raise self.error(task_name, f"raised {exc!r}") from exc

    def error(
        self, task_name: str, what_happened: str, name: str | None = None
    ) -> KeyFunctionError:
        """The KeyFunctionError for this function and task ``task_name``."""
        return KeyFunctionError(
            f"{self.what} function {describe(self.func)} of task {task_name} {what_happened}",
            name=name,
        )

    def _named_arguments(
        self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The call's arguments by name, as many as the function takes."""
        simple = self._binding.bind(args, kwargs) if self._binding is not None else None
        if simple is not None:
            if self._names is None:
                return simple
            return {n: simple[n] for n in self._names if n in simple}
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            hint = _bind_hint(self.signature, args, kwargs)
            raise TypeError(
                f"task {task_name} was called with arguments that do not fit "
                f"{describe(self.fn, self.signature)}: {exc}{hint}"
            ) from None
        bound.apply_defaults()
        named: dict[str, Any] = {}
        for pname, value in bound.arguments.items():
            if self.signature.parameters[pname].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[pname] = value
        if self._names is not None:
            named = {n: named[n] for n in self._names if n in named}
        return named


class KeyNaming:
    """The key of one decorated task function: a fixed name, or a key function of its
    arguments (checked here against the function's signature; ``where`` names the function)."""

    def __init__(self, fn: Callable[..., Any], key: str | KeyFunction, where: str) -> None:
        self.fn = fn
        self.key = key
        self.signature = inspect.signature(fn)
        self._by_name: ByName | None = None
        if isinstance(key, str):
            try:
                validate_name(key)
            except ConfigurationError as exc:
                raise ConfigurationError(f"key of {where}: {exc}") from None
        elif callable(key):
            instead = "pass a str key for one semaphore for all calls"
            self._by_name = ByName(fn, key, "key", where, instead)
        else:
            raise ConfigurationError(f"key of {where} must be a str or a callable, got {key!r}")

    def name_for(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The semaphore name for one call (``args`` as the function receives them)."""
        if self._by_name is None:
            return cast(str, self.key)
        key = self._by_name
        name = key(task_name, args, kwargs)
        if name is None:
            raise key.error(task_name, "returned None")
        if not isinstance(name, str):
            raise key.error(task_name, f"returned {type(name).__name__} {name!r:.80}, not a str")
        try:
            return validate_name(name)
        except ConfigurationError as exc:
            raise key.error(task_name, f"returned an unusable name: {exc}", exc.name) from None


class LimitRule:
    """The limit of one decorated task function: a fixed int, or a limit function of its
    arguments by name (as a key function), whose answer is checked on every call. ``what``
    and ``rule`` make it another count of the same kind (a rate limit's ``cost``)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        limit: int | LimitFunction,
        where: str,
        *,
        what: str = "limit",
        rule: Rule = LIMIT,
    ) -> None:
        self.fixed: int | None = None
        self.what = what
        self._rule = rule
        self._by_name: ByName | None = None
        if callable(limit) and not isinstance(limit, int):
            self._by_name = ByName(fn, limit, what, where, f"pass an int {what}")
        else:
            self.fixed = rule.check(limit, f"{what} of {where}")

    def __repr__(self) -> str:
        return repr(self.fixed) if self._by_name is None else describe(self._by_name.func)

    def limit_for(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
        """The limit for one call (``args`` as the function receives them)."""
        if self._by_name is None:
            return cast(int, self.fixed)
        limit = self._by_name(task_name, args, kwargs)
        try:
            checked: int = self._rule.check(limit, f"its {self.what}")
        except ConfigurationError as exc:
            raise self._by_name.error(task_name, f"returned {limit!r:.80}: {exc}") from None
        return checked
