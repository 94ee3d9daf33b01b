"""Naming a task run's semaphore: the key function, checked at decoration, called with the
task's arguments by name.

:class:`KeyNaming` checks a key function against the task function's signature when the
decorator is applied (a misspelt argument fails at import, not in a worker), and works out the
name for one call: a fixed str key, or what the key function returns for the arguments it
names. Whatever the key function raises, :exc:`SystemExit` and :exc:`KeyboardInterrupt`
included, becomes a :class:`~celery_redsem.KeyFunctionError`: it runs in the worker's main
process during admission, where an escaping exit would stop the worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from celery import Task

from celery_redsem.core.errors import ConfigurationError, KeyFunctionError
from celery_redsem.core.keys import validate_name

__all__ = ["KeyFunction", "KeyNaming", "call_arguments", "describe"]

KeyFunction = Callable[..., object]

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


def call_arguments(task: Task[Any, Any], args: Any) -> tuple[Any, ...]:
    """The positional arguments the task's function receives for a message's ``args``.

    With ``bind=True`` the function also receives the task. (``autoretry_for`` replaces
    ``run`` with a plain function and keeps the bound one as ``_orig_run``.)
    """
    call_args = tuple(args or ())
    if inspect.ismethod(getattr(task, "_orig_run", task.run)):
        call_args = (task, *call_args)
    return call_args


class KeyNaming:
    """The key of one decorated task function: a fixed name, or a key function of its
    arguments (checked here against the function's signature; ``where`` names the function)."""

    def __init__(self, fn: Callable[..., Any], key: str | KeyFunction, where: str) -> None:
        self.fn = fn
        self.key = key
        self.signature = inspect.signature(fn)
        self._key_names: list[str] | None = None  # None: the key takes **kwargs
        if isinstance(key, str):
            try:
                validate_name(key)
            except ConfigurationError as exc:
                raise ConfigurationError(f"key of {where}: {exc}") from None
        elif callable(key):
            self._key_names = self._check_key_function(key, where)
        else:
            raise ConfigurationError(f"key of {where} must be a str or a callable, got {key!r}")

    def _check_key_function(self, key: KeyFunction, where: str) -> list[str] | None:
        try:
            params = inspect.signature(key).parameters
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"cannot inspect key function of {where}: {exc}") from None
        task_params = self.signature.parameters
        task_takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in task_params.values())
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return None  # it takes whatever it is given
        names: list[str] = []
        for p in params.values():
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                raise ConfigurationError(
                    f"key function {describe(key)} of {where}: parameter {p.name!r} is "
                    "positional-only; the key receives the task's arguments by name"
                )
            if p.kind not in _NAMED_KINDS:
                continue  # *args, or positional-only with a default: never given a value
            if p.name not in task_params and not task_takes_kwargs and p.default is p.empty:
                raise ConfigurationError(
                    f"key function {describe(key)} of {where} asks for {p.name!r}, which is not "
                    f"a parameter of {where}{self.signature}"
                )
            names.append(p.name)
        receivable = [n for n in names if n in task_params or task_takes_kwargs]
        if params and not receivable:
            # Parameters, but none the task's arguments can fill (a misspelt name with a
            # default, only *args): every call would get one and the same name.
            raise ConfigurationError(
                f"key function {describe(key)} of {where} takes none of the task's arguments "
                f"({', '.join(params)} against {where}{self.signature}), so every call would "
                "share one semaphore; name the arguments it uses (key=lambda account_id: ...), "
                "or pass a str key for one semaphore for all calls"
            )
        return names

    def name_for(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The semaphore name for one call (``args`` as the function receives them)."""
        if isinstance(self.key, str):
            return self.key
        key = self.key
        named = self._named_arguments(task_name, args, kwargs)
        try:
            name = key(**named)
        except _KEY_FUNCTION_FAILURES as exc:
            raise KeyFunctionError(
                f"key function {describe(key)} of task {task_name} raised {exc!r}"
            ) from exc
        if name is None:
            raise KeyFunctionError(
                f"key function {describe(key)} of task {task_name} returned None"
            )
        if not isinstance(name, str):
            raise KeyFunctionError(
                f"key function {describe(key)} of task {task_name} returned "
                f"{type(name).__name__} {name!r:.80}, not a str"
            )
        try:
            return validate_name(name)
        except ConfigurationError as exc:
            raise KeyFunctionError(
                f"key function {describe(key)} of task {task_name} returned an unusable "
                f"name: {exc}",
                name=exc.name,
            ) from None

    def _named_arguments(
        self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The call's arguments by name, as many as the key function takes."""
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
        if self._key_names is not None:
            named = {n: named[n] for n in self._key_names if n in named}
        return named
