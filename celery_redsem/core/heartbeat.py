"""Keeping held permits alive: one scheduling thread per process, and refresher threads.

A running task's permit is tracked as a :class:`HeldPermit`. The :class:`Heartbeat` thread
finds each one due a third of a lease after it was last confirmed, and batches every permit
that is due (or nearly due) into one :func:`~celery_redsem.refresh_permits` call per client.

* **One client cannot hold up another.** The scheduling thread never calls Redis itself: it
  hands each client's calls to a small pool of refresher threads (at most
  :data:`MAX_REFRESHERS`, started on demand, ending when idle), with at most one call under
  way per client. A client stuck on a hung or black-holed server ties up one refresher; the
  permits on other clients go on being refreshed on time.

* **Stop before release.** :meth:`Heartbeat.untrack` comes before the release; a refresh that
  was in flight and reports the permit gone is then ignored, not reported as lost.
* **Errors are not loss.** When Redis cannot be reached the thread retries with a short
  backoff; it declares a permit lost only when a full lease has passed since the last
  confirmed refresh (measured from before that call was sent), i.e. when the lease really
  could have expired. A refresh that answers "not held" is a loss at once. The scheduling
  thread keeps that clock itself: a permit whose refresh call has not returned a lease after
  its last confirmation is declared lost then, not when (or if) the call returns.
* **Fork-safe.** A forked child starts with no heartbeat and no tracked permits; it makes its
  own threads on its first permit.
* **OS threads, also among greenlets.** Under gevent or eventlet (``-P gevent``,
  ``-P eventlet``) the threads are OS threads and refresh on a client of their own with the
  OS's sockets (:mod:`~celery_redsem.core.native`,
  :func:`~celery_redsem.core.connections.native_twin`), so a body that computes without
  yielding for longer than a lease keeps its permit; what they log and report goes through
  the main thread's hub. (A client that has no such twin, a cluster, Sentinel or TLS one, is
  refreshed from a greenlet.)
* **Back-off on errors.** A refresh that fails is tried again after 50 ms, doubling up to a
  sixth of the lease; a permit waiting for that retry is not refreshed sooner with the others.

On a loss the permit's ``lost_lease_policy`` applies: ``"log"`` logs an error; ``"raise"``
also raises :class:`LeaseInterrupt` (a :class:`~celery_redsem.PermitLost`) asynchronously in
the thread running the task body, via ``PyThreadState_SetAsyncExc``: it arrives at the next
Python bytecode, so a body blocked in a long C call (a socket read, ``time.sleep``) sees it
when that call returns. In a greenlet (gevent, eventlet) it is thrown into the body's
greenlet at its next yield: at once if it waits on I/O or sleeps. The body can also poll
:meth:`HeldPermit.check`.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar, overload

from celery_redsem.core import native
from celery_redsem.core.client import DEFAULT_IDLE_TTL, RedisClient
from celery_redsem.core.connections import native_twin
from celery_redsem.core.errors import REDIS_ERRORS, BackendError, PermitLost
from celery_redsem.core.lease_events import notify_loss
from celery_redsem.core.permits import Permit
from celery_redsem.core.refresh import refresh_permits
from celery_redsem.core.refreshers import Refreshers

__all__ = ["MAX_REFRESHERS", "Heartbeat", "HeldPermit", "LeaseInterrupt", "get_heartbeat"]

logger = logging.getLogger(__name__)

_IDLE_WAIT = 30.0
_FIRST_RETRY = 0.05
_MAX_DOUBLINGS = 30  # (2 ** 30 x 50 ms is far past any lease: the cap applies long before)
#: The most refresher threads a heartbeat runs: up to this many clients can hang at once
#: before a healthy one has to wait for a thread.
MAX_REFRESHERS = 8


class LeaseInterrupt(PermitLost):
    """Raised inside a task body when its permit is lost under the ``"raise"`` policy."""

    def __init__(self, message: str = "the permit's lease was lost while the task ran", **kw: Any):
        super().__init__(message, **kw)


def _set_async_exc(thread_id: int, exc_type: type[BaseException] | None) -> int:
    """Schedule ``exc_type`` in thread ``thread_id`` (None: cancel a pending one)."""
    target = ctypes.py_object(exc_type) if exc_type is not None else None
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), target))


T = TypeVar("T")


class _OfPermit(Generic[T]):
    """A field of a :class:`HeldPermit`'s latest permit, read through it."""

    def __init__(self, field: str, doc: str) -> None:
        self.field = field
        self.__doc__ = doc

    @overload
    def __get__(self, held: None, owner: type[Any]) -> _OfPermit[T]: ...
    @overload
    def __get__(self, held: HeldPermit, owner: type[Any]) -> T: ...
    def __get__(self, held: HeldPermit | None, owner: type[Any]) -> _OfPermit[T] | T:
        if held is None:
            return self
        value: T = getattr(held.permit, self.field)
        return value


class HeldPermit:
    """A permit held by a running task, kept fresh by the heartbeat.

    ``permit`` is the latest :class:`~celery_redsem.Permit` (its ``expires_at`` moves with each
    refresh; ``token`` never changes). ``lost`` turns True when the lease was lost.
    """

    def __init__(
        self,
        permit: Permit,
        client: RedisClient,
        *,
        idle_ttl: float = DEFAULT_IDLE_TTL,
        lost_lease_policy: str = "log",
        task_name: str = "",
        confirmed_at: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.idle_ttl = idle_ttl
        self.lost_lease_policy = lost_lease_policy
        self.task_name = task_name
        self.thread_id = threading.get_ident()
        self._greenlet: Any = None  # the body's greenlet, in a green process
        self._clock = clock
        self._lock = native.allocate_lock()
        self._permit = permit
        self._confirmed_at = clock() if confirmed_at is None else confirmed_at
        self._failures = 0
        self._next_due = self._confirmed_at + permit.lease / 3
        self._tracked = False
        self._lost = False
        self._armed = False
        self._injected = False

    def __repr__(self) -> str:
        state = "lost" if self._lost else "held"
        return f"<HeldPermit {self.name!r} id={self.id!r} token={self.token} {state}>"

    @property
    def permit(self) -> Permit:
        """The latest refreshed permit."""
        return self._permit

    id = _OfPermit[str]("id", "The permit id (a task's id).")
    name = _OfPermit[str]("name", "The semaphore's name.")
    token = _OfPermit[int]("token", "The fencing token of this grant.")
    expires_at = _OfPermit[int]("expires_at", "Lease expiry after the latest refresh, server ms.")

    @property
    def lost(self) -> bool:
        """True once the lease was found lost."""
        return self._lost

    def check(self) -> None:
        """Raise :class:`~celery_redsem.PermitLost` if the lease was lost."""
        if self._lost:
            raise self.lost_error()

    def lost_error(self) -> PermitLost:
        """The :class:`~celery_redsem.PermitLost` describing this permit's loss."""
        return PermitLost(
            f"permit {self.id!r} of {self.name!r} (task {self.task_name or '?'}) lost its lease "
            "while the task ran; another holder may have started",
            name=self.name,
            permit_id=self.id,
        )

    # -- used by the task guard ------------------------------------------------------------

    def arm(self) -> None:
        """From now on a loss under the "raise" policy interrupts this thread (or greenlet)."""
        with self._lock:
            self.thread_id = threading.get_ident()
            self._greenlet = native.current_greenlet()
            self._armed = True

    def disarm(self) -> None:
        """No more interrupts; cancel one that was scheduled but has not arrived yet."""
        with self._lock:
            self._armed = False
            if self._injected and self._greenlet is None:
                _set_async_exc(self.thread_id, None)
            # (a throw into a greenlet checks, in the hub, that the body is still armed)

    def _interrupt(self) -> bool:
        """Interrupt the armed body with :class:`LeaseInterrupt` (under the lock); whether an
        interrupt is on its way."""
        if self._greenlet is None:
            return _set_async_exc(self.thread_id, LeaseInterrupt) == 1
        native.throw_into(self._greenlet, LeaseInterrupt(), lambda: self._armed)
        return True

    # -- used by the heartbeat -------------------------------------------------------------

    def _confirm(self, permit: Permit, at: float) -> None:
        with self._lock:
            if self._tracked:
                self._permit = permit
                self._confirmed_at = max(self._confirmed_at, at)
                self._failures = 0
                self._next_due = self._confirmed_at + permit.lease / 3

    def _failed(self, now: float) -> bool:
        """After a refresh error: schedule a retry; True if the lease could have run out."""
        with self._lock:
            self._failures += 1
            doublings = min(self._failures - 1, _MAX_DOUBLINGS)
            delay = min(_FIRST_RETRY * 2**doublings, self._permit.lease / 6)
            self._next_due = now + delay
            return now >= self._deadline()

    def _due(self, now: float, slack: float) -> bool:
        """Whether a refresh is due now: within ``slack`` of its time (so due permits go in
        one call), or, after a failed one, at its retry time and not before."""
        return self._next_due <= now + (0.0 if self._failures else slack)

    def _deadline(self) -> float:
        """When the lease could have run out: a lease after the last confirmation (clock)."""
        return self._confirmed_at + self._permit.lease

    def lost_at_release(self) -> bool:
        """The release (after :meth:`Heartbeat.untrack`) found the permit no longer held: flag
        and log the loss, unless a refresh already did; True if this call flagged it."""
        with self._lock:
            if self._lost:
                return False
            self._lost = True
        _log_loss(
            self,
            "the release found it no longer held (released by an operator, or its "
            "lease ran out and another caller took it before the next refresh)",
        )
        return True

    def _mark_lost(self) -> bool:
        """Flag the loss (and interrupt the body under "raise"); False if already handled."""
        with self._lock:
            if not self._tracked or self._lost:
                return False
            self._lost = True
            self._tracked = False
            if self.lost_lease_policy == "raise" and self._armed and not self._injected:
                self._injected = self._interrupt()
            return True


class Heartbeat:
    """Refreshes every tracked :class:`HeldPermit` of this process: a daemon thread finds what
    is due and hands each client's refresh to a refresher thread."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = native.allocate_lock()
        self._held: set[HeldPermit] = set()
        self._wake = native.Wake()
        self._stopping = False
        self._thread: Any = None
        #: When the thread will next look (clock time); infinity while it is awake, so that a
        #: permit tracked while it works (perhaps after it last looked) always wakes it.
        self._wake_at = math.inf
        #: Clients (by id) with a refresh call handed out and not yet returned.
        self._in_flight: set[int] = set()
        self._refreshers = Refreshers(MAX_REFRESHERS)

    def track(self, held: HeldPermit) -> HeldPermit:
        """Start refreshing ``held`` (and start the thread if needed)."""
        native.prepare_green()  # (here, in the caller's greenlet: its hub is the one to reach)
        with held._lock:
            held._tracked = True
        with self._lock:
            self._held.add(held)
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = native.start_thread(
                    partial(_run, weakref.ref(self), self._wake), "redsem-heartbeat"
                )
        # Wake the thread only if it would look too late for this permit: waking it on every
        # task start makes it compete with the task for the GIL for nothing.
        if held._next_due < self._wake_at:
            self._wake.set()
        return held

    def untrack(self, held: HeldPermit) -> None:
        """Stop refreshing ``held``; call before releasing it."""
        with held._lock:
            held._tracked = False
        with self._lock:
            self._held.discard(held)

    def held(self) -> list[HeldPermit]:
        """The permits being refreshed now."""
        with self._lock:
            return list(self._held)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread (it restarts on the next :meth:`track`); idle refreshers end."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake.set()
        self._refreshers.end_idle()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)  # (an OS thread in a green process: joined all the same)

    def beat(self) -> float:
        """Hand out the refreshes that are due, declare lost the permits whose refresh has not
        answered for a lease; return the seconds until the next thing to do."""
        now = self._clock()
        with self._lock:
            held = list(self._held)
            busy = set(self._in_flight)
        if not held:
            return _IDLE_WAIT
        slack = min(h.permit.lease for h in held) / 6
        due: dict[int, dict[float, list[HeldPermit]]] = {}
        for h in held:
            if id(h.client) in busy:
                if now >= h._deadline():
                    self._lose(h, "no refresh answered for a whole lease (a call is still out)")
            elif h._due(now, slack):
                due.setdefault(id(h.client), {}).setdefault(h.idle_ttl, []).append(h)
        for client_id, groups in due.items():
            with self._lock:
                self._in_flight.add(client_id)
            self._refreshers.submit(partial(self._refresh_client, client_id, list(groups.values())))
        with self._lock:
            held = list(self._held)
            busy = set(self._in_flight)
        if not held:
            return _IDLE_WAIT
        next_at = min(h._deadline() if id(h.client) in busy else h._next_due for h in held)
        return max(0.0, next_at - self._clock())

    def _refresh_client(self, client_id: int, groups: list[list[HeldPermit]]) -> None:
        """Refresher thread: refresh one client's due groups, then wake the scheduler. In a
        green process, on the client's twin with the OS's sockets; a client without one is
        refreshed from a greenlet."""
        client: Any = groups[0][0].client
        if native.green_library() is not None:
            twin = native_twin(client, sockets=native.original_socket(), rlock=native.rlock)
            if twin is None:
                native.in_green(native.spawn_green, self._refresh_groups, client_id, groups, client)
                return
            client = twin
        self._refresh_groups(client_id, groups, client)

    def _refresh_groups(
        self, client_id: int, groups: list[list[HeldPermit]], client: RedisClient
    ) -> None:
        try:
            for group in groups:
                self._refresh(group, client)
        finally:
            with self._lock:
                self._in_flight.discard(client_id)
            self._wake.set()

    def _refresh(self, group: list[HeldPermit], client: RedisClient) -> None:
        sent_at = self._clock()
        try:
            result = refresh_permits(client, [h.permit for h in group], idle_ttl=group[0].idle_ttl)
        except (BackendError, *REDIS_ERRORS) as exc:
            self._unconfirmed(group, exc)
            return
        by_key = {(h.id, h.name, h.permit.prefix): h for h in group}
        for permit in result.refreshed:
            by_key[(permit.id, permit.name, permit.prefix)]._confirm(permit, sent_at)
        for permit in result.lost:
            self._lose(by_key[(permit.id, permit.name, permit.prefix)], "expired or released")
        if result.failed:  # some calls failed (a cluster node, an error reply): theirs wait
            unanswered = [by_key[(p.id, p.name, p.prefix)] for p in result.failed]
            self._unconfirmed(unanswered, result.error)

    def _unconfirmed(self, group: list[HeldPermit], error: Exception | None) -> None:
        """No answer for ``group``: not a loss until a whole lease passed without one."""
        now = self._clock()
        for h in group:
            if h._failed(now):
                self._lose(h, f"no refresh succeeded for a whole lease ({error})")
        native.in_green(
            logger.warning,
            "celery_redsem: refreshing %d permit(s) failed, will retry: %s",
            len(group),
            error,
        )

    def _lose(self, held: HeldPermit, why: str) -> None:
        with self._lock:
            self._held.discard(held)
        if held._mark_lost():
            native.in_green(_log_loss, held, why)


def _log_loss(held: HeldPermit, why: str) -> None:
    logger.error(
        "celery_redsem: permit %r of %r (task %s, token %d) lost its lease: %s",
        held.id,
        held.name,
        held.task_name or "?",
        held.token,
        why,
    )
    notify_loss(held)


def _run(ref: weakref.ReferenceType[Heartbeat], wake: native.Wake) -> None:
    """Thread body: holds the heartbeat only weakly, so an abandoned one lets the thread end."""
    while True:
        heartbeat = ref()
        if heartbeat is None or heartbeat._stopping:
            return
        heartbeat._wake_at = math.inf  # before looking: a track() from now on wakes it again
        wake.clear()
        try:
            wait = heartbeat.beat()
        except Exception:  # the thread must survive anything; the next beat retries
            native.in_green(logger.exception, "celery_redsem: heartbeat failed")
            wait = _FIRST_RETRY
        heartbeat._wake_at = heartbeat._clock() + wait
        del heartbeat
        wake.wait(wait)


_heartbeat: Heartbeat | None = None
_heartbeat_lock = native.allocate_lock()


def get_heartbeat() -> Heartbeat:
    """This process's heartbeat (created on first use)."""
    global _heartbeat  # noqa: PLW0603
    with _heartbeat_lock:
        if _heartbeat is None:
            _heartbeat = Heartbeat()
        return _heartbeat


def _after_fork_in_child() -> None:
    global _heartbeat, _heartbeat_lock  # noqa: PLW0603
    _heartbeat = None
    _heartbeat_lock = native.allocate_lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
