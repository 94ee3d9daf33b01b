"""The guard of one decorated task function: it runs the body under a permit and releases it.

:class:`SemaphoreGuard` names the semaphore of a call
(:class:`~celery_redsem.integration.guards.naming.KeyNaming`), gets its permit, runs the body and
releases. In a worker the permit id is the task id, stable across contention retries and
redelivery (a run that the task's own ``self.retry()`` or ``replace()`` queued gets one of its
own: :func:`~celery_redsem.core.permit_ids.run_permit_id`); the permit is one the worker's main
process handed over (:mod:`~celery_redsem.integration.wire`), or one the run asks for itself,
waiting or retrying as :mod:`~celery_redsem.integration.guards.contention` describes.

Eager calls (``task_always_eager``, ``apply()``) and direct calls block for a permit for at most
``redsem_eager_timeout`` seconds instead: countdowns mean nothing there.

Whatever way the body ends (return, exception, ``self.retry()``, ``Ignore``, ``Reject``, soft
time limit) the ``finally`` stops the heartbeat for the permit, then releases it.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, cast

from celery import Celery, Task
from celery._state import get_current_app, get_current_task
from celery.app.task import Context
from celery.exceptions import Retry

from celery_redsem.core.client import RedisClient, socket_timeout
from celery_redsem.core.errors import AcquireTimeout, BackendError, ConfigurationError
from celery_redsem.core.heartbeat import HeldPermit, LeaseInterrupt, get_heartbeat
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.core.validation import SECONDS, Rule
from celery_redsem.integration import wire
from celery_redsem.integration.dedupe import coalesce, coalesce_run, run_mark
from celery_redsem.integration.guards import sharing as fair
from celery_redsem.integration.guards.base import Guard, guards_of
from celery_redsem.integration.guards.contention import Contention
from celery_redsem.integration.guards.endings import ON_BUSY, busy, skipped, try_once
from celery_redsem.integration.guards.naming import LimitRule, call_arguments
from celery_redsem.integration.guards.reentry import Entered, enter, held_by_caller, leave
from celery_redsem.integration.line import release_quietly, server_ms
from celery_redsem.integration.policy import hold_times
from celery_redsem.integration.seam import active_apps
from celery_redsem.integration.settings import LOST_LEASE_POLICY, get_client, get_config
from celery_redsem.metrics import metrics_on, record_grant, record_grant_at_end, record_timeout

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

    from celery_redsem.integration.guards.naming import KeyFunction, LimitFunction
    from celery_redsem.integration.settings import RedsemConfig

__all__ = ["GuardOptions", "SemaphoreGuard"]

logger = logging.getLogger(__name__)


_Arguments = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class _Call:
    """One call of a guarded function: its task and request (None for a direct call)."""

    task: Task[Any, Any] | None
    request: Context | None
    app: Celery
    task_name: str
    name: str
    limit: int
    config: RedsemConfig
    share: fair.Share | None


class GuardOptions(TypedDict, total=False):
    """The options of ``@with_semaphore`` and ``@with_lock`` besides ``limit`` and ``key``
    (see :func:`~celery_redsem.with_semaphore` for their meaning and defaults; a test keeps
    its keywords and these equal)."""

    lease: float | None
    max_wait: float | None
    lost_lease_policy: str | None
    on_busy: str
    dedupe: bool | str
    debounce: float | None
    debounce_max: float | None
    fair_by: Callable[..., object] | None
    weight: float | Callable[..., object]
    group_limit: int | None


class SemaphoreGuard(Guard, kind="permit"):
    """The limit, key and options of one ``@with_semaphore`` (or ``@with_lock``) function:
    :meth:`run` calls it under a permit."""

    def __init__(
        self,
        fn: Callable[..., Any],
        limit: int | LimitFunction,
        key: str | KeyFunction,
        **options: Unpack[GuardOptions],
    ) -> None:
        where = getattr(fn, "__qualname__", repr(fn))
        lease, max_wait = options.get("lease"), options.get("max_wait")
        lost_lease_policy = options.get("lost_lease_policy")
        on_busy, dedupe = options.get("on_busy", "wait"), options.get("dedupe", False)
        self.limits = LimitRule(fn, limit, where)
        #: The limit if it is fixed, else None (a limit function: :meth:`limit_for`).
        self.limit: int | None = self.limits.fixed
        self.lease: float | None = _optional(SECONDS, lease, f"lease of {where}")
        if max_wait == 0 and not isinstance(max_wait, bool):
            raise ConfigurationError(
                f"max_wait of {where} must be > 0; for a run that does not wait for a busy "
                "key, use on_busy='skip' (it ends without running) or on_busy='fail' (it "
                "fails with Busy)"
            )
        super().__init__(fn, key, max_wait)
        self.lost_lease_policy: str | None = _optional(
            LOST_LEASE_POLICY, lost_lease_policy, f"lost_lease_policy of {where}"
        )
        self.on_busy: str = ON_BUSY.check(on_busy, f"on_busy of {where}")
        self.dedupe = run_mark.DEDUPE.check(dedupe, f"dedupe of {where}")
        self.debounce = coalesce.check_debounce(
            self.dedupe, options.get("debounce"), options.get("debounce_max"), where
        )
        self.sharing: fair.Sharing | None = fair.sharing_of(fn, options, where)  # who shares

    def __repr__(self) -> str:
        return f"<SemaphoreGuard {self.where} limit={self.limits!r} key={self.key!r}>"

    def limit_for(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
        """The limit for one call (``args`` as the function receives them)."""
        return self.limits.limit_for(task_name, args, kwargs)

    def name_and_limit(
        self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[str, int]:
        """The semaphore name and limit for one call."""
        return self.name_for(task_name, args, kwargs), self.limit_for(task_name, args, kwargs)

    def naming_for(
        self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[str, int, fair.Share | None]:
        """The semaphore name, limit, and group and weight (None: not shared fairly) of a call."""
        share = fair.share_of(self.sharing, task_name, args, kwargs)
        return (*self.name_and_limit(task_name, args, kwargs), share)

    def semaphore(
        self,
        app: Celery,
        name: str,
        config: RedsemConfig | None = None,
        limit: int | None = None,
        share: fair.Share | None = None,
    ) -> FairSemaphore:
        """The semaphore ``name`` with ``limit`` (default: the fixed one), asking in ``share``."""
        config = config or get_config(app)
        limit = self.limit if limit is None else limit
        if limit is None:
            raise ConfigurationError(f"{self!r} computes its limit per call: pass limit=")
        sem = _semaphore(
            get_client(app),
            name,
            limit,
            lease=self.lease or config.lease,
            idle_ttl=config.idle_ttl,
            prefix=config.key_prefix,
            min_replicas=config.min_replicas,
            replica_timeout=config.replica_timeout,
            **fair.fair_settings(self.sharing),
        )
        return sem if share is None else sem.in_group(*share)

    # -- running -----------------------------------------------------------------------------

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the function under a permit (see the module docstring)."""
        task = cast("Task[Any, Any] | None", get_current_task())
        ours = task is not None and self in guards_of(task, SemaphoreGuard)
        app = task.app if task is not None else self._app_of_direct_call()
        task_name = task.name if task is not None and ours else self.fn.__qualname__
        config = get_config(app)
        name, limit, share = self.naming_for(task_name, args, kwargs)
        outer = held_by_caller(name, config.key_prefix, limit)
        if outer is not None:
            # Re-entrant: a guarded call running in this thread holds this semaphore already,
            # and this call runs inside it (a task calling itself, or another task on the same
            # key, synchronously; an eager .delay() in a task body). Its permit covers this
            # call, unless it was lost: then nothing covers it.
            if outer.lost:
                raise outer.lost_error()
            return self.fn(*args, **kwargs)
        request = task.request if task is not None and ours else None
        call = _Call(task, request, app, task_name, name, limit, config, share)
        mark = self._run_mark(call)
        if mark is not None and request is not None and (other := mark.claim(request)):
            return self._duplicate(call, other)
        started = time.monotonic()
        sem, permit, confirmed_at, (args, kwargs) = self._permit(
            call, mark, started, (args, kwargs)
        )
        if permit is None:  # on_busy="skip", and the key is busy
            return self._skip_busy(call, mark, args, kwargs)
        # From the grant on, every way out releases: nothing may run between it and the try.
        heartbeat = get_heartbeat()
        held: HeldPermit | None = None
        entered: Entered | None = None
        body_started = time.monotonic()
        gone_at_release = False  # the release found the permit no longer held
        retried = False
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
            entered = enter(held, limit)
            if request is not None:
                setattr(request, "redsem_permit", held)  # noqa: B010 (not in the stubs)
            body_started = time.monotonic()
            self._record_grant(call, permit, started, handed=confirmed_at is not None)
            result = self._run_body(held, args, kwargs)
        except Retry:
            retried = True  # the same task id comes back: its mark stays
            raise
        finally:
            hold_times.observe(task_name, time.monotonic() - body_started)
            if entered is not None:
                leave(entered)
            if held is not None:
                heartbeat.untrack(held)  # stop refreshing before releasing
            if release_quietly(sem, permit) is False and held is not None:
                # Lost before the next refresh could tell (an operator's release, or a
                # stall past the lease): reported as a refresh would have.
                gone_at_release = held.lost_at_release()
            if mark is not None:
                mark.end(clear=not retried)
        if gone_at_release and held is not None and held.lost_lease_policy == "raise":
            raise held.lost_error()
        return result

    def _permit(
        self, call: _Call, mark: run_mark.RunMark | None, started: float, arguments: _Arguments
    ) -> tuple[FairSemaphore, Permit | None, float | None, _Arguments]:
        """The semaphore and the run's permit (None: on_busy="skip" and the key is busy),
        when the grant was confirmed if the main process handed it over, and the arguments
        the body runs with (a coalesced run's may be newer). Whatever ends the run here (a
        failure, not a retry) clears its dedupe mark."""
        request = call.request
        got: tuple[FairSemaphore, Permit | None, float | None]
        try:
            if request is None or request.called_directly or request.is_eager:
                sem = self.semaphore(call.app, call.name, call.config, call.limit, call.share)
                pid = permit_id_of(request) if request is not None and request.id else None
                got = sem, self._acquire_blocking(sem, pid or uuid.uuid4().hex, call), None
            else:
                got = self._worker_permit(call, request, started)
        except Retry:
            raise  # the same task id comes back: its mark stays
        except BaseException:
            if mark is not None:
                mark.end()
            raise
        if mark is not None and got[1] is not None:
            mark.hold(got[1].id)  # live from now on as long as the permit is
            if call.task is not None and request is not None:  # (releases if it raises)
                arguments = mark.take_over(call.task, request, got[0], got[1], arguments)
        return (*got, arguments)

    def _worker_permit(
        self, call: _Call, request: Context, started: float
    ) -> tuple[FairSemaphore, Permit | None, float | None]:
        """In a worker: the semaphore and permit, and when the grant was confirmed if it was
        handed over by the main process; retries the task (raises) when none can be had, or
        with ``on_busy`` not "wait", fails (raises) or gives no permit (None: skip)."""
        task, name, config = call.task, call.name, call.config
        assert task is not None
        what = f"a permit of {name!r} (limit {call.limit})"
        ask = Contention(task, request, name, what, self.max_wait_for(config.max_wait), config)
        try:  # building a cluster client already talks to the cluster
            sem = self.semaphore(task.app, name, config, call.limit, call.share)
        except BackendError as exc:
            ask.retry_after_error(exc, started=started)
        standby = wire.take_standby(request)
        handed = wire.take_grant(request, sem.name, sem.keys.prefix, sem.lease)
        if handed is not None and time.monotonic() - handed[1] <= sem.lease / 3:
            return sem, handed[0], handed[1]  # granted in the main process, moments ago
        # No grant, or one that waited for this child longer than the heartbeat would have
        # let it (a child slow to start): its lease may have run out and the permit gone to
        # another task. Asking again under the task id renews it if it is still held.
        if self.on_busy == "wait":
            granted = ask.permit_or_retry(sem, standby=standby)
            if standby:  # the main process held its acknowledgement back until now
                wire.tell_granted(str(request.id))
            return sem, granted, None
        permit = ask.try_once(sem, started=started)
        if permit is None and self.on_busy == "fail":
            raise busy(task.name, request.id, sem)
        return sem, permit, None

    def _app_of_direct_call(self) -> Celery:
        """The app of the task this guard is on, for a ``task.run(...)`` call (no task on the
        stack): a finalized app that registered it, else the current app."""
        for app in active_apps():
            if getattr(app, "finalized", False) and any(
                self in guards_of(t) for t in list(app.tasks.values())
            ):
                return app
        return get_current_app()

    def _record_grant(self, call: _Call, permit: Permit, started: float, *, handed: bool) -> None:
        """Count the run's grant (asked for at monotonic ``started``) in the metrics, with its
        wait since the first ask of earlier retries or parking, if any (``handed``: by the
        main process, which counted it)."""
        if handed or not metrics_on():
            return
        request, task = call.request, call.task
        in_worker = request is not None and not request.is_eager and not request.called_directly
        since_ms = wire.read_wait(request).first_ms if in_worker and request is not None else 0
        if since_ms > 0:
            waited = (server_ms(permit, 0) - since_ms) / 1000
        else:
            waited = time.monotonic() - started
        if in_worker and len(guards_of(task)) > 1:
            record_grant_at_end(request, call.task_name, waited)
        else:
            record_grant(call.task_name, waited)

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

    def _acquire_blocking(self, sem: FairSemaphore, permit_id: str, call: _Call) -> Permit | None:
        """A permit for an eager or direct call: blocking (or with ``on_busy`` not "wait",
        one try: None for "skip", :class:`~celery_redsem.Busy` for "fail")."""
        task_name, config = call.task_name, call.config
        if self.on_busy != "wait":
            permit = try_once(sem, permit_id)
            if permit is None and self.on_busy == "fail":
                raise busy(task_name, permit_id, sem)
            return permit
        try:
            permit = sem.acquire(blocking=True, timeout=config.eager_timeout, permit_id=permit_id)
        except BackendError:  # granted, maybe, with the reply lost: give it back, as hold() does
            release_quietly(sem, permit_id)
            raise
        if permit is None:
            record_timeout(task_name)
            raise AcquireTimeout(
                f"task {task_name} (eager or direct call) got no permit of {sem.name!r} "
                f"(limit {sem.limit}) within redsem_eager_timeout={config.eager_timeout}s",
                name=sem.name,
                permit_id=permit_id,
            )
        return permit

    def release_run(self, task: Task[Any, Any], request: Any) -> bool:
        """Give up whatever permit or place the run ``request`` has (main process, after the
        child died, or for a revoked or expired task), and with ``dedupe``, its mark."""
        permit_id = permit_id_of(request)
        args, kwargs = call_arguments(task, request.args), dict(request.kwargs or {})
        try:
            name, limit = self.name_and_limit(task.name, args, kwargs)
        except (ConfigurationError, TypeError) as exc:  # (a bad key or limit function)
            logger.warning(
                "celery_redsem: could not work out the semaphore of %s[%s] in the worker's main "
                "process to release its permit (%s); if it held one, the permit frees when its "
                "lease ends",
                task.name,
                permit_id,
                exc,
            )
            return False
        if self.dedupe == "coalesce" and request.id:
            coalesce.abandon(task, name, request.id)
        elif self.dedupe and request.id:
            run_mark.clear_quietly(run_mark.mark_of(task.app, name), request.id)
        return release_quietly(self.semaphore(task.app, name, limit=limit), permit_id) is True

    def give_back_grant(
        self, task: Task[Any, Any], request: Any, call: tuple[tuple[Any, ...], Mapping[str, Any]]
    ) -> bool:
        """Release a permit the worker's main process granted this run (see :class:`Guard`)."""
        if not wire.has_grant(request):
            return False
        try:
            name, limit = self.name_and_limit(task.name, *call)
            sem = self.semaphore(task.app, name, limit=limit)
        except (ConfigurationError, BackendError, TypeError):
            return False
        handed = wire.take_grant(request, sem.name, sem.keys.prefix, sem.lease)
        if handed is not None:
            release_quietly(sem, handed[0])
        return handed is not None

    def _run_mark(self, call: _Call) -> run_mark.RunMark | None:
        """The dedupe mark this run keeps, if it has one (not for direct calls)."""
        request = call.request
        if not self.dedupe or request is None or request.called_directly or not request.id:
            return None
        if self.dedupe == "coalesce":
            return coalesce_run.CoalesceRun(
                call.app, call.name, request.id, call.config, self.debounce
            )
        return run_mark.RunMark(call.app, call.name, request.id, call.config)

    def _skip_busy(
        self,
        call: _Call,
        mark: run_mark.RunMark | None,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> None:
        """End a run with on_busy="skip" whose key is busy (see :mod:`.busy`)."""
        if mark is not None:
            mark.end()
        request = call.request
        if request is not None:
            args, kwargs = tuple(request.args or ()), request.kwargs or {}
        task_id = request.id if request else None
        skipped(call.task, task_id, call.name, "busy", args=args, kwargs=kwargs)

    def _duplicate(self, call: _Call, other: str) -> None:
        """End a run that another run of its key (``other``) makes a duplicate."""
        assert call.task is not None
        assert call.request is not None
        sem = self.semaphore(call.app, call.name, call.config, call.limit, call.share)
        run_mark.end_duplicate(call.task, call.request, sem, other, self.dedupe)


#: The semaphores of this process, by client, name and settings: one is built (and checks its
#: settings) once, not on every ask and every run. (A FairSemaphore keeps no state of its own
#: between calls; a forked child has a client of its own, so it never finds its parent's.)
#: A new name is a renamed copy of one with the same settings (:meth:`FairSemaphore.renamed`).
@functools.lru_cache(maxsize=1024)
def _semaphore(client: RedisClient, name: str, limit: int, **settings: Any) -> FairSemaphore:
    try:
        return _settings_of(client, limit, **settings).renamed(name)
    except ConfigurationError:  # reported with this name
        return FairSemaphore(client, name, limit, **settings)


@functools.lru_cache(maxsize=64)
def _settings_of(client: RedisClient, limit: int, **settings: Any) -> FairSemaphore:
    return FairSemaphore(client, "settings", limit, **settings)


def _optional(rule: Rule, value: object, what: str) -> Any:
    """``value`` checked by ``rule``, or None if it is None (the app's setting applies)."""
    return None if value is None else rule.check(value, what)


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
