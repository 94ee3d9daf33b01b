"""What a guarded task does when it runs: name its semaphore, get a permit or retry, run, release.

In a worker the permit id is the task id, stable across retries and redelivery. The task asks
once (:meth:`~celery_redsem.FairSemaphore.attempt`, joining the FIFO line); without a permit it
re-publishes itself with a countdown and raises Celery's ``Retry``. That contention retry keeps
``request.retries`` as it is and never touches ``max_retries``; its count and the server time of
the first try travel in the message header ``redsem_wait``. A task whose wait exceeds
``max_wait`` leaves the line and fails with :class:`~celery_redsem.AcquireTimeout`.

Eager calls (``task_always_eager``, ``apply()``) and direct calls block for a permit for at most
``redsem_eager_timeout`` seconds instead: countdowns mean nothing there.

Whatever way the body ends (return, exception, ``self.retry()``, ``Ignore``, ``Reject``, soft
time limit) the ``finally`` stops the heartbeat for the permit, then releases it.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any, cast

import redis
from celery import Celery, Task
from celery._state import get_current_app, get_current_task
from celery.app.task import Context
from celery.exceptions import Retry

from .backoff import contention_countdown, hold_times
from .config import LOST_LEASE_POLICIES, RedsemConfig, get_client, get_config
from .errors import AcquireTimeout, BackendError, ConfigurationError, KeyFunctionError
from .heartbeat import HeldPermit, LeaseInterrupt, get_heartbeat
from .keys import validate_name
from .permits import Permit, Waiting
from .semaphore import FairSemaphore

__all__ = ["WAIT_HEADER", "KeyFunction", "TaskGuard", "current_permit", "guards_of"]

logger = logging.getLogger(__name__)

#: Message header carrying ``[contention retries so far, server ms of the first try, retries]``.
WAIT_HEADER = "redsem_wait"

KeyFunction = Callable[..., object]

_current: ContextVar[HeldPermit | None] = ContextVar("celery_redsem_permit", default=None)
_GUARD_ATTR = "__redsem_guard__"
_BLOCK_SLICE = 1.0  # one BLPOP stays well inside the default 2 s socket timeout
_NAMED_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def current_permit() -> HeldPermit | None:
    """The permit of the innermost guarded task running in this context, or None.

    Its ``token`` is the fencing token; ``check()`` raises :class:`~celery_redsem.PermitLost`
    if the lease was lost.
    """
    return _current.get()


def guards_of(task: object) -> list[TaskGuard]:
    """The guards on a task's ``run`` (outermost first), or an empty list."""
    found: list[TaskGuard] = []
    fn: object = getattr(task, "run", None)
    fn = getattr(fn, "__func__", fn)
    while fn is not None and len(found) < 16:
        guard = getattr(fn, "__dict__", {}).get(_GUARD_ATTR)
        if isinstance(guard, TaskGuard) and guard not in found:
            found.append(guard)
        fn = getattr(fn, "__wrapped__", None)
    return found


def _describe(fn: object) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


class TaskGuard:
    """The limit, key and options of one decorated task function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        limit: int,
        key: str | KeyFunction,
        lease: float | None = None,
        max_wait: float | None = None,
        lost_lease_policy: str | None = None,
    ) -> None:
        where = getattr(fn, "__qualname__", repr(fn))
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"limit of {where} must be an int >= 1, got {limit!r}")
        self.fn = fn
        self.limit = limit
        self.lease = _optional_seconds(lease, "lease", where)
        self.max_wait = _optional_seconds(max_wait, "max_wait", where, inf_ok=True)
        if lost_lease_policy is not None and lost_lease_policy not in LOST_LEASE_POLICIES:
            raise ConfigurationError(
                f"lost_lease_policy of {where} must be one of {LOST_LEASE_POLICIES}, "
                f"got {lost_lease_policy!r}"
            )
        self.lost_lease_policy = lost_lease_policy
        self._signature = inspect.signature(fn)
        self.key = key
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

    def __repr__(self) -> str:
        return f"<TaskGuard {self.fn.__qualname__} limit={self.limit} key={self.key!r}>"

    def _check_key_function(self, key: KeyFunction, where: str) -> list[str] | None:
        try:
            params = inspect.signature(key).parameters
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"cannot inspect key function of {where}: {exc}") from None
        task_params = self._signature.parameters
        task_takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in task_params.values())
        names: list[str] = []
        for p in params.values():
            if p.kind is p.VAR_KEYWORD:
                return None
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                raise ConfigurationError(
                    f"key function {_describe(key)} of {where}: parameter {p.name!r} is "
                    "positional-only; the key receives the task's arguments by name"
                )
            if p.kind not in _NAMED_KINDS:
                continue
            if p.name not in task_params and not task_takes_kwargs and p.default is p.empty:
                raise ConfigurationError(
                    f"key function {_describe(key)} of {where} asks for {p.name!r}, which is not "
                    f"a parameter of {where}{self._signature}"
                )
            names.append(p.name)
        return names

    # -- naming the semaphore ----------------------------------------------------------------

    def name_for(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The semaphore name for one call (``args`` as the function receives them)."""
        if isinstance(self.key, str):
            return self.key
        key = self.key
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        named: dict[str, Any] = {}
        for pname, value in bound.arguments.items():
            if self._signature.parameters[pname].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[pname] = value
        if self._key_names is not None:
            named = {n: named[n] for n in self._key_names if n in named}
        try:
            name = key(**named)
        except Exception as exc:
            raise KeyFunctionError(
                f"key function {_describe(key)} of task {task_name} raised {exc!r}"
            ) from exc
        if name is None:
            raise KeyFunctionError(
                f"key function {_describe(key)} of task {task_name} returned None"
            )
        if not isinstance(name, str):
            raise KeyFunctionError(
                f"key function {_describe(key)} of task {task_name} returned "
                f"{type(name).__name__} {name!r:.80}, not a str"
            )
        try:
            return validate_name(name)
        except ConfigurationError as exc:
            raise KeyFunctionError(
                f"key function {_describe(key)} of task {task_name} returned an unusable "
                f"name: {exc}",
                name=exc.name,
            ) from None

    def semaphore(
        self, app: Celery, name: str, config: RedsemConfig | None = None
    ) -> FairSemaphore:
        """The semaphore ``name`` with this guard's limit and the app's settings."""
        config = config or get_config(app)
        return FairSemaphore(
            get_client(app),
            name,
            self.limit,
            lease=self.lease or config.lease,
            idle_ttl=config.idle_ttl,
            prefix=config.key_prefix,
        )

    # -- running -----------------------------------------------------------------------------

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the function under a permit (see the module docstring)."""
        task = cast("Task[Any, Any] | None", get_current_task())
        ours = task is not None and self in guards_of(task)
        app = task.app if task is not None else get_current_app()
        task_name = task.name if task is not None and ours else self.fn.__qualname__
        config = get_config(app)
        name = self.name_for(task_name, args, kwargs)
        sem = self.semaphore(app, name, config)
        request = task.request if task is not None and ours else None
        started = time.monotonic()
        if request is None or request.called_directly or request.is_eager:
            pid = (request.id if request is not None else None) or uuid.uuid4().hex
            permit = self._acquire_blocking(sem, pid, task_name, config)
        else:
            assert task is not None
            permit = self._attempt_or_retry(task, request, sem, config)
        held = HeldPermit(
            permit,
            sem.client,
            idle_ttl=config.idle_ttl,
            lost_lease_policy=self.lost_lease_policy or config.lost_lease_policy,
            task_name=task_name,
            confirmed_at=started,
        )
        heartbeat = get_heartbeat()
        heartbeat.track(held)
        token = _current.set(held)
        if request is not None:
            setattr(request, "redsem_permit", held)  # noqa: B010 (not in the stubs)
        body_started = time.monotonic()
        try:
            return self._run_body(held, args, kwargs)
        finally:
            hold_times.observe(task_name, time.monotonic() - body_started)
            _current.reset(token)
            heartbeat.untrack(held)
            _release(sem, permit)

    def _run_body(self, held: HeldPermit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            try:
                held.arm()
                result = self.fn(*args, **kwargs)
            finally:
                _disarm(held)
        except LeaseInterrupt:
            if held._injected:
                raise held.lost_error() from None
            raise
        if held.lost and held.lost_lease_policy == "raise":
            raise held.lost_error()
        return result

    def _acquire_blocking(
        self, sem: FairSemaphore, permit_id: str, task_name: str, config: RedsemConfig
    ) -> Permit:
        permit = sem.acquire(blocking=True, timeout=config.eager_timeout, permit_id=permit_id)
        if permit is None:
            raise AcquireTimeout(
                f"task {task_name} (eager or direct call) got no permit of {sem.name!r} "
                f"(limit {sem.limit}) within redsem_eager_timeout={config.eager_timeout}s",
                name=sem.name,
                permit_id=permit_id,
            )
        return permit

    def _attempt_or_retry(
        self, task: Task[Any, Any], request: Context, sem: FairSemaphore, config: RedsemConfig
    ) -> Permit:
        task_id = cast(str, request.id)
        attempts, first_ms = _read_wait_header(request)
        waiter_lease = config.waiter_margin + config.retry_min_countdown
        result = sem.attempt(task_id, join_line=True, waiter_lease=waiter_lease)
        if isinstance(result, Permit):
            return result
        now_ms = result.expires_at - round(waiter_lease * 1000)
        first_ms = first_ms or now_ms
        waited = max(0, now_ms - first_ms) / 1000
        max_wait = self.max_wait if self.max_wait is not None else config.max_wait
        if max_wait is not None and math.isinf(max_wait):
            max_wait = None
        if config.head_wait > 0 and result.position <= sem.limit:
            budget = (
                config.head_wait if max_wait is None else min(config.head_wait, max_wait - waited)
            )
            result = _wait_at_head(sem, task_id, result, waiter_lease, budget)
            if isinstance(result, Permit):
                return result
            now_ms = result.expires_at - round(waiter_lease * 1000)
            waited = max(0, now_ms - first_ms) / 1000
        if max_wait is not None and waited >= max_wait:
            _release(sem, task_id)
            raise AcquireTimeout(
                f"task {task.name}[{task_id}] waited {waited:.1f}s for a permit of {sem.name!r} "
                f"(limit {sem.limit}) and gave up (max_wait={max_wait}s, {attempts} retries, "
                f"position {result.position} in line)",
                name=sem.name,
                permit_id=task_id,
            )
        countdown = contention_countdown(
            attempt=attempts,
            position=result.position,
            limit=sem.limit,
            hold_estimate=hold_times.estimate(task.name),
            backoff=config.retry_backoff,
            backoff_max=config.retry_backoff_max,
            jitter=config.retry_jitter,
            floor=config.retry_min_countdown,
        )
        if max_wait is not None:
            countdown = max(config.retry_min_countdown, min(countdown, max_wait - waited))
        # Keep the place until the task is back, and let a permit it cannot use while it is
        # away go to whoever is present: its place holds one only once the countdown is over.
        again = sem.attempt(
            task_id,
            join_line=True,
            waiter_lease=countdown + config.waiter_margin,
            back_in=countdown,
        )
        if isinstance(again, Permit):
            return again
        headers = dict(request.headers or {})
        headers[WAIT_HEADER] = [attempts + 1, first_ms, request.retries]
        sig = task.signature_from_request(request, countdown=countdown, headers=headers)
        try:
            sig.apply_async()
        except Exception:
            _release(sem, task_id)
            raise
        raise Retry(
            f"no permit of {sem.name!r} (limit {sem.limit}) yet; "
            f"position {result.position} in line, asking again in {countdown:.3f}s",
            when=cast(Any, countdown),
            sig=sig,
        )

    def release_by_id(
        self,
        app: Celery,
        task_name: str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        task_id: str,
    ) -> bool:
        """Give up whatever permit or place ``task_id`` has (main process, after the child died)."""
        try:
            name = self.name_for(task_name, args, kwargs)
        except (KeyFunctionError, TypeError) as exc:
            logger.debug("celery_redsem: no semaphore for %s[%s]: %s", task_name, task_id, exc)
            return False
        return _release(self.semaphore(app, name), task_id)


def _optional_seconds(
    value: object, what: str, where: str, *, inf_ok: bool = False
) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigurationError(
            f"{what} of {where} must be a number of seconds > 0, got {value!r}"
        )
    if (math.isinf(value) and not inf_ok) or math.isnan(value):
        raise ConfigurationError(f"{what} of {where} must be finite, got {value!r}")
    return float(value)


def _read_wait_header(request: Context) -> tuple[int, int | None]:
    """(contention retries so far, server ms of the first try) for this run of the task."""
    headers = request.headers or {}
    value = headers.get(WAIT_HEADER, getattr(request, WAIT_HEADER, None))
    if not isinstance(value, list | tuple) or len(value) != 3:
        return 0, None
    attempts, first_ms, retries = value
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return 0, None
    if retries != request.retries:  # the task's own retry since: a fresh wait
        return 0, None
    return max(0, attempts), first_ms


def _wait_at_head(
    sem: FairSemaphore, task_id: str, result: Waiting, waiter_lease: float, seconds: float
) -> Permit | Waiting:
    """Next in line: wait in this worker slot to be woken by a release, for up to ``seconds``.

    A freed permit is reserved for the head of the line; a head that is away on a countdown
    leaves it idle, so the head waits here instead (on its wake-up list, one BLPOP per wake).
    """
    deadline = time.monotonic() + seconds
    wake = sem.keys.wake(task_id)
    while result.position <= sem.limit:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            sem.client.blpop([wake], timeout=max(0.01, min(remaining, _BLOCK_SLICE)))
        except redis.RedisError as exc:
            raise BackendError(
                f"Redis failed while waiting for {sem.name!r}: {exc}", name=sem.name
            ) from exc
        attempt = sem.attempt(task_id, join_line=True, waiter_lease=waiter_lease)
        if isinstance(attempt, Permit):
            return attempt
        result = attempt
    return result


def _disarm(held: HeldPermit) -> None:
    """Disarm ``held``, absorbing an interrupt that arrives just as the body ends."""
    while True:
        try:
            held.disarm()
        except LeaseInterrupt:
            continue
        return


def _release(sem: FairSemaphore, permit: Permit | str) -> bool:
    try:
        return sem.release(permit)
    except BackendError as exc:
        pid = permit.id if isinstance(permit, Permit) else permit
        logger.warning(
            "celery_redsem: could not release %r of %r (it frees itself when its lease ends): %s",
            pid,
            sem.name,
            exc,
        )
        return False


def iter_guarded_tasks(app: Celery) -> Iterator[tuple[Task[Any, Any], list[TaskGuard]]]:
    """Every registered task of ``app`` that carries a guard, with its guards."""
    for task in list(app.tasks.values()):
        guards = guards_of(task)
        if guards:
            yield task, guards
