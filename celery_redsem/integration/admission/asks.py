"""Admission's asks for permits, sent from the worker's event loop without waiting for Redis.

Admission asks for a permit on every dispatch of a guarded task, in the worker's main process,
whose event loop also fetches messages, hands tasks to the pool and reads their results. A call
that waits for its reply holds all of that up for a round trip (far longer than the script
itself on a busy host), and a burst of arrivals waits one round trip per task.

:class:`PipelinedAsks` sends each ask (acquire.lua's EVALSHA) on a connection of its own and
returns at once; the event loop reads the replies when the socket is readable, in the order
the asks were sent (one connection, so several asks are in flight at once: a burst of arrivals
costs about one round trip, not one each), and hands each to its callback. Asks still
unanswered after the client's socket timeout (:data:`DEFAULT_DEADLINE` without one) fail with
:class:`~celery_redsem.BackendError`, as a broken connection fails every ask in flight; the
next ask opens a new connection (through the pool, so Sentinel finds the current primary).
A ``NOSCRIPT`` reply loads the script and sends the ask again.

:class:`WaitingAsks` is the same interface for clients it does not suit (Redis Cluster, a
client class of its own) and for pools without an event loop: each ask waits for its reply
and calls back before it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import NoScriptError, ResponseError

from celery_redsem.core.client import socket_timeout
from celery_redsem.core.connections import check_out, socket_fileno
from celery_redsem.core.errors import REDIS_ERRORS, BackendError
from celery_redsem.core.scripts import ACQUIRE, script_failed
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.integration.line import Answer, attempt

__all__ = ["DEFAULT_DEADLINE", "Answer", "Asks", "PipelinedAsks", "WaitingAsks", "asks_for"]

logger = logging.getLogger(__name__)

#: Seconds an ask may go unanswered when the client sets no socket timeout.
DEFAULT_DEADLINE = 10.0
#: How often (seconds) the event loop looks for asks past their deadline.
_CHECK_EVERY = 1.0

Callback = Callable[[Answer], None]


@dataclass(frozen=True)
class _Ask:
    sem: FairSemaphore
    permit_id: str
    waiter_lease: float
    back_in: float
    done: Callback
    sent_at: float
    notify: str | None = None

    @property
    def command(self) -> tuple[Any, ...]:
        return self.sem.attempt_command(
            self.permit_id,
            join_line=True,
            waiter_lease=self.waiter_lease,
            back_in=self.back_in,
            notify=self.notify,
        )


class Asks:
    """Sends admission's asks (acquire.lua, joining the line) and calls back with answers."""

    def ask(
        self,
        sem: FairSemaphore,
        permit_id: str,
        *,
        waiter_lease: float,
        back_in: float,
        done: Callback,
        notify: str | None = None,
    ) -> None:
        """Ask for ``permit_id``'s permit of ``sem`` (never one with ``min_replicas``); ``done``
        gets the answer, maybe later. ``notify``: a grouped semaphore's channel for offers."""
        self._send(_Ask(sem, permit_id, waiter_lease, back_in, done, time.monotonic(), notify))

    def _send(self, ask: _Ask) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Give up the connection (asks in flight fail)."""


class WaitingAsks(Asks):
    """Each ask waits for its reply (the plain client call) and calls back before it returns."""

    def _send(self, ask: _Ask) -> None:
        answer: Answer
        try:
            answer = attempt(
                ask.sem,
                ask.permit_id,
                waiter_lease=ask.waiter_lease,
                back_in=ask.back_in,
                notify=ask.notify,
            )
        except BackendError as exc:
            answer = exc
        ask.done(answer)


class PipelinedAsks(Asks):
    """Asks sent on a connection of their own; replies read when the event loop sees them."""

    def __init__(self, hub: Any, client: redis.Redis) -> None:
        self._hub = hub
        self._client = client
        self._pool = client.connection_pool
        self._connection: Any = None
        self._fd: int | None = None
        self._in_flight: deque[_Ask] = deque()
        timeout = socket_timeout(client)
        self._deadline = DEFAULT_DEADLINE if timeout is None else timeout
        self._checker = hub.timer.call_repeatedly(_CHECK_EVERY, self._check_deadline)

    def close(self) -> None:
        self._break(ConnectionError("admission stopped"))
        try:
            self._hub.timer.cancel(self._checker)
        except Exception:  # the timer is being torn down with the worker
            logger.debug("celery_redsem: could not cancel the ask deadline check", exc_info=True)

    # -- sending and reading -------------------------------------------------------------------

    def _send(self, ask: _Ask) -> None:
        try:
            connection = self._connected()
            # Its deadline counts from now: connecting (on a slow link, the handshake's round
            # trips) is not the ask's time.
            ask = dataclasses.replace(ask, sent_at=time.monotonic())
            connection.send_packed_command(
                connection.pack_command(*ask.command), check_health=False
            )
        except REDIS_ERRORS as exc:
            self._in_flight.append(ask)  # fails with the others in flight
            self._break(exc)
            return
        self._in_flight.append(ask)

    def _connected(self) -> Any:
        if self._fd is not None and self._hub.readers.get(self._fd) is None:
            # The event loop forgot the socket (a broker reconnection resets it): the
            # replies in flight would never be read.
            self._break(ConnectionError("the worker's event loop was reset"))
        if self._in_flight and time.monotonic() - self._in_flight[0].sent_at > self._deadline:
            self._break(TimeoutError(f"no reply from Redis within {self._deadline}s"))
        if self._connection is None:
            connection: Any = check_out(self._pool)
            try:
                connection.connect()  # (a no-op if the pool handed it out connected)
                fd = socket_fileno(connection)
            except BaseException:
                self._pool.release(connection)
                raise
            self._connection, self._fd = connection, fd
            self._hub.add_reader(fd, self._on_readable)
        return self._connection

    def _on_readable(self, *_: Any) -> None:
        """Read every reply that has arrived and answer its ask (the oldest in flight first)."""
        connection = self._connection
        while self._in_flight and connection is not None:
            try:
                reply: Any = connection.read_response()
            except ResponseError as exc:  # the server's answer to this ask, read in full
                reply = exc
            except REDIS_ERRORS as exc:
                self._break(exc)
                return
            self._answer(self._in_flight.popleft(), reply)
            try:
                if not self._in_flight or not connection.can_read(timeout=0):
                    return
            except REDIS_ERRORS as exc:
                self._break(exc)
                return
        if connection is not None and not self._in_flight:
            # Readable with nothing asked: the server closed the connection (or sent what no
            # ask waits for). Start afresh with the next ask.
            self._break(ConnectionError("the connection to Redis closed"))

    def _answer(self, ask: _Ask, reply: Any) -> None:
        if isinstance(reply, NoScriptError):  # the server lost its scripts: load, ask again
            try:
                ask.sem.load_scripts()
            except BackendError as exc:
                _call(ask.done, exc)
                return
            self._send(ask)  # (with a deadline of its own: see _send)
            return
        answer: Answer
        if isinstance(reply, ResponseError):
            answer = script_failed(ACQUIRE, ask.sem.name, reply)
        else:
            try:
                answer = ask.sem.attempt_reply(ask.permit_id, reply)
            except (TypeError, ValueError) as exc:  # not acquire.lua's reply
                answer = BackendError(
                    f"unexpected reply to acquire.lua for {ask.sem.name!r}: {reply!r} ({exc})",
                    name=ask.sem.name,
                )
        _call(ask.done, answer)

    def _check_deadline(self) -> None:
        if self._in_flight and time.monotonic() - self._in_flight[0].sent_at > self._deadline:
            self._break(TimeoutError(f"no reply from Redis within {self._deadline}s"))

    def _break(self, exc: BaseException) -> None:
        """Drop the connection; every ask in flight fails with ``exc``."""
        connection, fd = self._connection, self._fd
        self._connection = self._fd = None
        if fd is not None:
            try:
                self._hub.remove_reader(fd)
            except Exception:  # the hub is closing
                logger.debug("celery_redsem: could not unregister the asks' socket", exc_info=True)
        if connection is not None:
            try:
                connection.disconnect()
            finally:
                self._pool.release(connection)
        failed, self._in_flight = self._in_flight, deque()
        for ask in failed:
            error = BackendError(
                f"Redis failed while admission asked for a permit of {ask.sem.name!r}: {exc}",
                name=ask.sem.name,
                permit_id=ask.permit_id,
            )
            error.__cause__ = exc
            _call(ask.done, error)


def _call(done: Callback, answer: Answer) -> None:
    """Hand ``answer`` to its callback; a failure there must not stop the other answers."""
    try:
        done(answer)
    except Exception:
        logger.exception("celery_redsem: admission failed to act on the answer %r", answer)


def asks_for(hub: Any, client: Any) -> Asks:
    """Pipelined asks for a plain ``redis.Redis`` client in a worker with an event loop, else
    asks that wait for their replies."""
    if hub is None or type(client) is not redis.Redis or client.connection is not None:
        return WaitingAsks()
    return PipelinedAsks(hub, client)
