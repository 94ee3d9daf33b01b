"""What a guarded task does when it runs: name its semaphore, get a permit or retry, run, release.

In a worker the permit id is the task id, stable across contention retries and redelivery (a
run that the task's own ``self.retry()`` or ``replace()`` queued gets one of its own:
:func:`~celery_redsem.core.permit_ids.run_permit_id`). The task asks
once (:meth:`~celery_redsem.FairSemaphore.attempt`, joining the FIFO line); without a permit it
waits for it in its worker slot if it is near
(:func:`~celery_redsem.integration.backoff.head_wait_budget`),
else it re-publishes itself with a countdown and raises Celery's ``Retry``, its place in line
holding a free permit for it only from about when it is expected back (the countdown plus the
delivery delay learnt for its queue, :class:`~celery_redsem.integration.backoff.ReturnDelays`). That
contention retry keeps ``request.retries`` as it is and never touches ``max_retries``; its count
and timing travel in the message header ``redsem_wait`` (:class:`WaitState`). A task whose wait
exceeds ``max_wait`` leaves the line and fails with :class:`~celery_redsem.AcquireTimeout`.

When Redis cannot be reached while a task asks for its permit (a restart, a failover, a
network fault, a server busy or out of memory: a :class:`~celery_redsem.BackendError` that is
:attr:`~celery_redsem.BackendError.transient`), the task is retried the same way, with an
exponential backoff, counted apart in the header; the time so spent counts toward
``max_wait``, after which the task fails with the ``BackendError``. A refusal no retry can fix
(a wrong password, a missing ACL permission, a script error) fails the task at once with the
``BackendError``. Either way it is never dropped.

Eager calls (``task_always_eager``, ``apply()``) and direct calls block for a permit for at most
``redsem_eager_timeout`` seconds instead: countdowns mean nothing there.

Whatever way the body ends (return, exception, ``self.retry()``, ``Ignore``, ``Reject``, soft
time limit) the ``finally`` stops the heartbeat for the permit, then releases it.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, cast

from celery import Celery, Task
from celery import _state as celery_state
from celery._state import get_current_app, get_current_task
from celery.app.task import Context
from celery.exceptions import Retry

from celery_redsem.core.client import socket_timeout
from celery_redsem.core.errors import (
    REDIS_ERRORS,
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    KeyFunctionError,
)
from celery_redsem.core.heartbeat import HeldPermit, LeaseInterrupt, get_heartbeat
from celery_redsem.core.keys import validate_name
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit, Waiting
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.integration.backoff import (
    contention_countdown,
    error_countdown,
    head_wait_budget,
    hold_times,
    return_delays,
)
from celery_redsem.integration.config import (
    LOST_LEASE_POLICIES,
    RedsemConfig,
    get_client,
    get_config,
)
from celery_redsem.integration.handoff import take_over

__all__ = [
    "WAIT_HEADER",
    "KeyFunction",
    "TaskGuard",
    "WaitState",
    "call_arguments",
    "current_permit",
    "guards_of",
    "present_waiter_lease",
]

logger = logging.getLogger(__name__)

#: Message header carrying a :class:`WaitState` (and the task's own retry count).
WAIT_HEADER = "redsem_wait"

KeyFunction = Callable[..., object]


@dataclass(frozen=True)
class _Entered:
    """A permit a guarded call holds while its body runs, in the thread running it."""

    held: HeldPermit
    limit: int
    thread_id: int


#: Every permit held by the guarded calls running in this context, outermost first (the last
#: is :func:`current_permit`).
_entered: ContextVar[tuple[_Entered, ...]] = ContextVar("celery_redsem_entered", default=())
_GUARD_ATTR = "__redsem_guard__"
_BLOCK_SLICE = 1.0  # one BLPOP stays well inside the default 2 s socket timeout
_MIN_POLL = 0.005
_NAMED_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def current_permit() -> HeldPermit | None:
    """The permit of the innermost guarded task running in this context, or None.

    Its ``token`` is the fencing token; ``check()`` raises :class:`~celery_redsem.PermitLost`
    if the lease was lost.
    """
    entered = _entered.get()
    return entered[-1].held if entered else None


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


def _describe(fn: object, signature: inspect.Signature | None = None) -> str:
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
        self.signature = inspect.signature(fn)
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
        task_params = self.signature.parameters
        task_takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in task_params.values())
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return None  # it takes whatever it is given
        names: list[str] = []
        for p in params.values():
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                raise ConfigurationError(
                    f"key function {_describe(key)} of {where}: parameter {p.name!r} is "
                    "positional-only; the key receives the task's arguments by name"
                )
            if p.kind not in _NAMED_KINDS:
                continue  # *args, or positional-only with a default: never given a value
            if p.name not in task_params and not task_takes_kwargs and p.default is p.empty:
                raise ConfigurationError(
                    f"key function {_describe(key)} of {where} asks for {p.name!r}, which is not "
                    f"a parameter of {where}{self.signature}"
                )
            names.append(p.name)
        receivable = [n for n in names if n in task_params or task_takes_kwargs]
        if params and not receivable:
            # Parameters, but none the task's arguments can fill (a misspelt name with a
            # default, only *args): every call would get one and the same name.
            raise ConfigurationError(
                f"key function {_describe(key)} of {where} takes none of the task's arguments "
                f"({', '.join(params)} against {where}{self.signature}), so every call would "
                "share one semaphore; name the arguments it uses (key=lambda account_id: ...), "
                "or pass a str key for one semaphore for all calls"
            )
        return names

    # -- naming the semaphore ----------------------------------------------------------------

    def name_for(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The semaphore name for one call (``args`` as the function receives them)."""
        if isinstance(self.key, str):
            return self.key
        key = self.key
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            hint = _bind_hint(self.signature, args, kwargs)
            raise TypeError(
                f"task {task_name} was called with arguments that do not fit "
                f"{_describe(self.fn, self.signature)}: {exc}{hint}"
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
            min_replicas=config.min_replicas,
            replica_timeout=config.replica_timeout,
        )

    # -- running -----------------------------------------------------------------------------

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the function under a permit (see the module docstring)."""
        task = cast("Task[Any, Any] | None", get_current_task())
        ours = task is not None and self in guards_of(task)
        app = task.app if task is not None else self._app_of_direct_call()
        task_name = task.name if task is not None and ours else self.fn.__qualname__
        config = get_config(app)
        name = self.name_for(task_name, args, kwargs)
        outer = self._held_by_caller(name, config.key_prefix)
        if outer is not None:
            # Re-entrant: a guarded call running in this thread holds this semaphore already,
            # and this call runs inside it (a task calling itself, or another task on the same
            # key, synchronously; an eager .delay() in a task body). Its permit covers this
            # call, unless it was lost: then nothing covers it.
            if outer.lost:
                raise outer.lost_error()
            return self.fn(*args, **kwargs)
        request = task.request if task is not None and ours else None
        started = time.monotonic()
        confirmed_at: float | None = None  # when the lease surely had not started yet
        if request is None or request.called_directly or request.is_eager:
            sem = self.semaphore(app, name, config)
            pid = permit_id_of(request) if request is not None and request.id else uuid.uuid4().hex
            permit = self._acquire_blocking(sem, pid, task_name, config)
        else:
            assert task is not None
            sem, permit, confirmed_at = self._worker_permit(task, request, name, config, started)
        # From the grant on, every way out releases: nothing may run between it and the try.
        heartbeat = get_heartbeat()
        held: HeldPermit | None = None
        entered: Token[tuple[_Entered, ...]] | None = None
        body_started = time.monotonic()
        gone_at_release = False  # the release found the permit no longer held
        try:
            held = HeldPermit(
                permit,
                sem.client,
                idle_ttl=config.idle_ttl,
                lost_lease_policy=self.lost_lease_policy or config.lost_lease_policy,
                task_name=task_name,
                confirmed_at=(
                    _granted_no_earlier_than(sem, started) if confirmed_at is None else confirmed_at
                ),
            )
            heartbeat.track(held)
            entered = _entered.set(
                (*_entered.get(), _Entered(held, self.limit, threading.get_ident()))
            )
            if request is not None:
                setattr(request, "redsem_permit", held)  # noqa: B010 (not in the stubs)
            body_started = time.monotonic()
            result = self._run_body(held, args, kwargs)
        finally:
            hold_times.observe(task_name, time.monotonic() - body_started)
            if entered is not None:
                _entered.reset(entered)
            if held is not None:
                heartbeat.untrack(held)  # stop refreshing before releasing
            if _release(sem, permit) is False and held is not None:
                # Lost before the next refresh could tell (an operator's release, or a
                # stall past the lease): reported as a refresh would have.
                gone_at_release = held.lost_at_release()
        if gone_at_release and held is not None and held.lost_lease_policy == "raise":
            raise held.lost_error()
        return result

    def _worker_permit(
        self,
        task: Task[Any, Any],
        request: Context,
        name: str,
        config: RedsemConfig,
        started: float,
    ) -> tuple[FairSemaphore, Permit, float | None]:
        """In a worker: the semaphore and permit, and when the grant was confirmed if it was
        handed over by the main process; retries the task (raises) when none can be had."""
        try:  # building a cluster client already talks to the cluster
            sem = self.semaphore(task.app, name, config)
        except BackendError as exc:
            wait = _read_wait_header(request)
            self._retry_after_error(task, request, name, config, wait, error=exc, started=started)
        handed = take_over(request, sem.name, sem.keys.prefix, sem.lease)
        if handed is not None and time.monotonic() - handed[1] <= sem.lease / 3:
            return sem, handed[0], handed[1]  # granted in the main process, moments ago
        # No grant, or one that waited for this child longer than the heartbeat would have
        # let it (a child slow to start): its lease may have run out and the permit gone to
        # another task. Asking again under the task id renews it if it is still held.
        return sem, self._attempt_or_retry(task, request, sem, config), None

    def _held_by_caller(self, name: str, prefix: str) -> HeldPermit | None:
        """The permit of semaphore ``name`` that a guarded call running in this thread holds
        with this guard's limit, if any (not one from a copied context in another thread)."""
        me = threading.get_ident()
        for entered in reversed(_entered.get()):
            held = entered.held
            if (
                held.name == name
                and held.permit.prefix == prefix
                and entered.limit == self.limit
                and entered.thread_id == me
            ):
                return held
        return None

    def _app_of_direct_call(self) -> Celery:
        """The app of the task this guard is on, for a ``task.run(...)`` call (no task on the
        stack): a finalized app that registered it, else the current app."""
        for app in list(celery_state._get_active_apps()):  # type: ignore[attr-defined]
            if app.finalized and any(self in guards_of(t) for t in list(app.tasks.values())):
                return cast(Celery, app)
        return get_current_app()

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
        wait = _read_wait_header(request)
        started = time.monotonic()
        try:
            return self._attempt_or_wait(task, request, sem, config, wait)
        except BackendError as exc:
            self._retry_after_error(
                task, request, sem.name, config, wait, error=exc, started=started
            )

    def max_wait_for(self, config: RedsemConfig) -> float | None:
        """This guard's wait budget in seconds under ``config`` (None: no cap)."""
        max_wait = self.max_wait if self.max_wait is not None else config.max_wait
        return None if max_wait is None or math.isinf(max_wait) else max_wait

    def _attempt_or_wait(
        self,
        task: Task[Any, Any],
        request: Context,
        sem: FairSemaphore,
        config: RedsemConfig,
        wait: WaitState,
    ) -> Permit:
        """Ask once; wait in the slot if the permit is near, else re-publish with a countdown."""
        task_id = cast(str, request.id)
        permit_id = permit_id_of(request)  # this run's: see run_permit_id
        queue = _queue_of(task, request)
        waiter_lease = present_waiter_lease(config)
        result = _attempt(sem, permit_id, waiter_lease=waiter_lease)
        now_ms = _server_ms(result, waiter_lease)
        if wait.due_ms and not wait.offline_ms:  # back from a contention retry: how late?
            return_delays.observe(queue, (now_ms - wait.due_ms) / 1000)
        if isinstance(result, Permit):
            return result
        # The first answer from Redis starts the wait, backdated by any time spent unable to
        # reach it before that.
        # (Never later than now: a header claiming so, forged or from a server whose clock
        # went back, would stop the wait from ever counting toward max_wait.)
        first_ms = min(wait.first_ms or now_ms - wait.offline_ms, now_ms)
        waited = max(0, now_ms - first_ms) / 1000
        max_wait = self.max_wait_for(config)
        hold = hold_times.estimate(task.name)
        budget = head_wait_budget(
            position=result.position,
            limit=sem.limit,
            hold_estimate=hold,
            head_wait=config.head_wait,
        )
        if max_wait is not None:
            budget = min(budget, max_wait - waited)
        if budget > 0:
            result = _wait_in_slot(
                sem, permit_id, result, waiter_lease=waiter_lease, seconds=budget, hold=hold
            )
            if isinstance(result, Permit):
                return result
            now_ms = _server_ms(result, waiter_lease)
            waited = max(0, now_ms - first_ms) / 1000
        if max_wait is not None and waited >= max_wait:
            _release(sem, permit_id)
            raise AcquireTimeout(
                f"task {task.name}[{task_id}] waited {waited:.1f}s for a permit of {sem.name!r} "
                f"(limit {sem.limit}) and gave up (max_wait={max_wait}s, {wait.attempts} "
                f"retries, position {result.position} in line)",
                name=sem.name,
                permit_id=permit_id,
            )
        countdown = contention_countdown(
            attempt=wait.attempts,
            position=result.position,
            limit=sem.limit,
            hold_estimate=hold,
            backoff=config.retry_backoff,
            backoff_max=config.retry_backoff_max,
            jitter=config.retry_jitter,
            floor=config.retry_min_countdown,
        )
        countdown = _within_budget(countdown, config, max_wait, waited)
        # Keep the place until the task is back. The broker hands the retry back only after
        # the messages queued before it, so the task is back around its countdown plus the
        # delay learnt for this queue; until then its place does not hold a free permit (one
        # goes to whoever is present, in line order), and the place outlives that by the margin.
        back_in = countdown + return_delays.estimate(queue)
        again = _attempt(
            sem, permit_id, waiter_lease=back_in + config.waiter_margin, back_in=back_in
        )
        if isinstance(again, Permit):
            return again
        due_ms = now_ms + round(countdown * 1000)
        after = WaitState(wait.attempts + 1, first_ms, wait.errors, due_ms, 0)
        raise self._publish_retry(
            task,
            request,
            countdown,
            after,
            release=sem,
            reason=f"no permit of {sem.name!r} (limit {sem.limit}) yet; "
            f"position {result.position} in line",
        )

    def _retry_after_error(
        self,
        task: Task[Any, Any],
        request: Context,
        name: str,
        config: RedsemConfig,
        wait: WaitState,
        *,
        error: BackendError,
        started: float,
    ) -> NoReturn:
        """Redis could not be reached: retry through Celery with a backoff (or fail at once
        if the error is not transient).

        Like a contention retry it spares ``max_retries``; its own count travels in the header.
        The time spent so (countdowns plus the failed tries) counts toward ``max_wait``, and
        once that is spent the task fails with the :class:`BackendError`.
        """
        task_id = cast(str, request.id)
        if not error.transient:
            raise BackendError(
                f"task {task.name}[{task_id}] could not get a permit of {name!r} "
                f"(limit {self.limit}): Redis refused in a way no retry can fix "
                f"({type(error.__cause__).__name__}): {error}",
                name=name,
                permit_id=task_id,
            ) from error
        offline_ms = wait.offline_ms + round((time.monotonic() - started) * 1000)
        # Without a server clock: the wait known at the last answer, plus the time offline.
        known = max(0, wait.due_ms - wait.first_ms) if wait.first_ms else 0
        waited = (known + offline_ms) / 1000
        max_wait = self.max_wait_for(config)
        if max_wait is not None and waited >= max_wait:
            raise BackendError(
                f"task {task.name}[{task_id}] could not get a permit of {name!r} "
                f"(limit {self.limit}) because Redis failed; it gave up after about "
                f"{waited:.1f}s (max_wait={max_wait}s, {wait.errors} retries after Redis "
                f"errors): {error}",
                name=name,
                permit_id=task_id,
            ) from error
        countdown = error_countdown(
            attempt=wait.errors,
            backoff=config.retry_backoff,
            backoff_max=config.retry_backoff_max,
            jitter=config.retry_jitter,
            floor=config.retry_min_countdown,
        )
        countdown = _within_budget(countdown, config, max_wait, waited)
        logger.warning(
            "celery_redsem: %s[%s] could not reach Redis for a permit of %r, retrying in "
            "%.2fs (retry %d after Redis errors): %s",
            task.name,
            task_id,
            name,
            countdown,
            wait.errors + 1,
            error,
        )
        after = WaitState(
            wait.attempts,
            wait.first_ms,
            wait.errors + 1,
            wait.due_ms,
            offline_ms + round(countdown * 1000),
        )
        raise self._publish_retry(
            task,
            request,
            countdown,
            after,
            release=None,
            reason=f"Redis failed while asking for a permit of {name!r}: {error}",
            error=error,
        )

    def _publish_retry(
        self,
        task: Task[Any, Any],
        request: Context,
        countdown: float,
        wait: WaitState,
        *,
        release: FairSemaphore | None,
        reason: str,
        error: Exception | None = None,
    ) -> Retry:
        """Re-publish the task (same id) with ``countdown`` and ``wait`` in its header; return
        the Celery ``Retry`` for the caller to raise, so this run ends in state RETRY.

        If publishing fails, the place in ``release`` (if given) is given up before re-raising.
        """
        headers = dict(request.headers or {})
        headers[WAIT_HEADER] = wait.header(request.retries)
        sig = task.signature_from_request(request, countdown=countdown, headers=headers)
        try:
            sig.apply_async()
        except Exception:
            if release is not None:
                _release(release, permit_id_of(request))
            raise
        return Retry(
            f"{reason}; asking again in {countdown:.3f}s",
            exc=error,
            when=cast(Any, countdown),
            sig=sig,
        )

    def release_by_id(
        self,
        app: Celery,
        task_name: str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        permit_id: str,
    ) -> bool:
        """Give up whatever permit or place the task run ``permit_id`` has (main process, after
        the child died)."""
        try:
            name = self.name_for(task_name, args, kwargs)
        except (KeyFunctionError, TypeError) as exc:
            logger.warning(
                "celery_redsem: could not work out the semaphore of %s[%s] in the worker's main "
                "process to release its permit (%s); if it held one, the permit frees when its "
                "lease ends",
                task_name,
                permit_id,
                exc,
            )
            return False
        return _release(self.semaphore(app, name), permit_id) is True


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


#: Highest retry count read from a ``redsem_wait`` header.
_MAX_COUNT = 64


class WaitState(NamedTuple):
    """Where a task stands in its wait for a permit; travels in the ``redsem_wait`` header."""

    #: Contention retries so far.
    attempts: int = 0
    #: Server ms when the wait began (0: Redis has not answered yet).
    first_ms: int = 0
    #: Retries because Redis failed (unreachable, restarting, too few replicas).
    errors: int = 0
    #: Server ms when the task was due back after its last contention retry (0: none yet).
    due_ms: int = 0
    #: Milliseconds spent on retries after Redis errors since then (countdowns and tries).
    offline_ms: int = 0

    def header(self, retries: int) -> list[int]:
        """The header value; ``retries`` (the task's own) tells a later own retry apart."""
        return [self.attempts, self.first_ms, retries, self.errors, self.due_ms, self.offline_ms]


def _read_wait_header(request: Context) -> WaitState:
    """The :class:`WaitState` this run of the task starts from (fresh if none or stale).

    Reads ``[attempts, first ms, retries, errors, due ms, offline ms]`` and the older
    ``[attempts, first ms, retries]``.
    """
    headers = request.headers or {}
    value = headers.get(WAIT_HEADER, getattr(request, WAIT_HEADER, None))
    if not isinstance(value, list | tuple) or len(value) not in (3, 6):
        return WaitState()
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return WaitState()
    attempts, first_ms, retries, *rest = value
    if retries != request.retries:  # the task's own retry since: a fresh wait
        return WaitState()
    errors, due_ms, offline_ms = rest or (0, 0, 0)
    # Counts feed an exponential backoff (2 ** n): bounded, whatever a message says.
    return WaitState(
        min(attempts, _MAX_COUNT), first_ms, min(errors, _MAX_COUNT), due_ms, offline_ms
    )


def _wait_in_slot(
    sem: FairSemaphore,
    permit_id: str,
    result: Waiting,
    *,
    waiter_lease: float,
    seconds: float,
    hold: float | None,
) -> Permit | Waiting:
    """Wait in this worker slot for a permit for up to ``seconds`` (see :func:`head_wait_budget`).

    A release pushes a wake-up to the first waiters in line; a task further back, or behind
    waiters that are away, asks again after about one release (``hold / limit``) instead.
    """
    deadline = time.monotonic() + seconds
    wake = sem.keys.wake(permit_id)
    poll = _BLOCK_SLICE if hold is None else min(_BLOCK_SLICE, max(_MIN_POLL, hold / sem.limit))
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return result
        try:
            sem.client.blpop([wake], timeout=max(_MIN_POLL, min(remaining, poll)))
        except REDIS_ERRORS as exc:
            raise BackendError(
                f"Redis failed while waiting for {sem.name!r}: {exc}", name=sem.name
            ) from exc
        attempt = _attempt(sem, permit_id, waiter_lease=waiter_lease)
        if isinstance(attempt, Permit):
            return attempt
        result = attempt


def _within_budget(
    countdown: float, config: RedsemConfig, max_wait: float | None, waited: float
) -> float:
    """``countdown``, cut to what is left of ``max_wait`` (never below the minimum countdown)."""
    if max_wait is None:
        return countdown
    return max(config.retry_min_countdown, min(countdown, max_wait - waited))


def present_waiter_lease(config: RedsemConfig) -> float:
    """The waiter lease of a task asking now: it keeps its place for the shortest countdown
    plus the margin, enough to be re-published or parked before asking again with its own."""
    return config.waiter_margin + config.retry_min_countdown


def _attempt(
    sem: FairSemaphore, permit_id: str, *, waiter_lease: float, back_in: float = 0.0
) -> Permit | Waiting:
    """One try that keeps the task run's place in line (``permit_id``: see :func:`permit_id_of`).

    A grant that too few replicas acknowledged in time was not used (``min_replicas``): that
    is a fault of the deployment, retried like a Redis error.
    """
    result = sem.attempt(permit_id, join_line=True, waiter_lease=waiter_lease, back_in=back_in)
    if isinstance(result, Waiting) and not result.expires_at:
        raise BackendError(
            f"a permit of {sem.name!r} was granted but not acknowledged by "
            f"min_replicas={sem.min_replicas} replicas in time, so it was not used",
            name=sem.name,
            permit_id=permit_id,
        )
    return result


def _server_ms(result: Permit | Waiting, waiter_lease: float) -> int:
    """The server's clock (ms) when ``result`` was decided, from the expiry it carries."""
    if isinstance(result, Permit):
        return result.expires_at - math.ceil(result.lease * 1000)
    return result.expires_at - math.ceil(waiter_lease * 1000)


def _queue_of(task: Task[Any, Any], request: Context) -> str:
    """The queue (routing key) the task came through: return delays are learnt per queue."""
    info = request.delivery_info or {}
    return str(info.get("routing_key") or getattr(task, "queue", None) or task.name)


def call_arguments(task: Task[Any, Any], args: Any) -> tuple[Any, ...]:
    """The positional arguments the task's function receives for a message's ``args``.

    With ``bind=True`` the function also receives the task. (``autoretry_for`` replaces
    ``run`` with a plain function and keeps the bound one as ``_orig_run``.)
    """
    call_args = tuple(args or ())
    if inspect.ismethod(getattr(task, "_orig_run", task.run)):
        call_args = (task, *call_args)
    return call_args


def _granted_no_earlier_than(sem: FairSemaphore, started: float) -> float:
    """A monotonic time the permit's lease surely did not start before.

    The grant came with the last of the calls that asked for it, and no call outlasts the
    socket timeout; before ``started`` nothing was asked. The heartbeat counts the lease from
    here, so a wait in line longer than a lease does not make the permit look expired at once.
    """
    timeout = socket_timeout(sem.client)
    if timeout is None:
        return started
    return max(started, time.monotonic() - timeout)


def _disarm(held: HeldPermit) -> None:
    """Disarm ``held``, absorbing an interrupt that arrives just as the body ends."""
    while True:
        try:
            held.disarm()
        except LeaseInterrupt:
            continue
        return


def _release(sem: FairSemaphore, permit: Permit | str) -> bool | None:
    """Give ``permit`` back: True if it was held, False if not, None if Redis failed (logged)."""
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
        return None


def iter_guarded_tasks(app: Celery) -> Iterator[tuple[Task[Any, Any], list[TaskGuard]]]:
    """Every registered task of ``app`` that carries a guard, with its guards."""
    for task in list(app.tasks.values()):
        guards = guards_of(task)
        if guards:
            yield task, guards
