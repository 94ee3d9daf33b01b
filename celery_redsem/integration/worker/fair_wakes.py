"""A worker's Pub/Sub channel for the offers of grouped (fair-share) semaphores.

Admission parks a task that cannot have its permit yet, unacknowledged and away from the
line (:mod:`~celery_redsem.integration.admission`). On a grouped semaphore the next permit
belongs to the head of the group first in fair order, which may be parked on any worker: a
release that woke the task parked first *here* would serve whichever group happens to be
parked here, not the one whose turn it is. So a parked task of a grouped semaphore gives this
worker's channel when it asks (``notify=``); when its turn comes, the release *offers* it the
permit (its place holds the permit for it, for at most 2 s) and publishes its permit id on
the channel. :class:`FairWakes` listens and hands the id to admission, which wakes that task.

On pools with an event loop (prefork, threads) the subscription's socket is read when the
loop sees it readable; on gevent and eventlet a greenlet waits on it. A lost connection is
opened again a second later (then less often while that fails, up to every 30 s); meanwhile
no ask gives the channel (:attr:`FairWakes.channel` is None), so no permit is held for a task
that would not hear of it, and parked tasks of grouped semaphores are woken as the others are
(by their timers, and by runs ending here).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import redis

from celery_redsem.core.connections import socket_fileno
from celery_redsem.core.errors import REDIS_ERRORS

__all__ = ["OFFER_SECONDS", "RECONNECT_AFTER", "RECONNECT_AT_MOST", "FairWakes", "Offers"]

logger = logging.getLogger(__name__)

#: Seconds before a lost subscription is opened again; doubled after each try that fails, up
#: to :data:`RECONNECT_AT_MOST` (a try on the event loop waits for the connection).
RECONNECT_AFTER = 1.0
RECONNECT_AT_MOST = 30.0
#: Seconds an offered place holds its permit (``OFFER_MS`` in ``_fair.lua``).
OFFER_SECONDS = 2.0
_MAX_NAMES = 4096


class FairWakes:
    """Listens on one channel of this worker and calls ``offered(permit_id)`` in admission's
    event loop for every permit id published on it.

    Start it with :meth:`start_in_hub` (prefork, threads) or :meth:`start_green` (gevent,
    eventlet); :meth:`close` stops it. Only a plain ``redis.Redis`` client is listened with
    (see :meth:`usable`).
    """

    def __init__(self, client: redis.Redis, prefix: str, offered: Callable[[str], None]) -> None:
        self._client = client
        self._offered = offered
        self._name = f"{prefix}:offers:{uuid.uuid4().hex}"
        self._pubsub: Any = None
        self._hub: Any = None
        self._fd: int | None = None
        self._closed = False
        self._failed = 0  # tries to subscribe that failed in a row

    @staticmethod
    def usable(client: object) -> bool:
        """Whether offers can be listened for with ``client`` (a plain ``redis.Redis``: a
        cluster's Pub/Sub is spread over its nodes)."""
        return type(client) is redis.Redis

    @property
    def channel(self) -> str | None:
        """The channel asks give (``notify=``) while subscribed; None while not."""
        return self._name if self._pubsub is not None else None

    # -- with an event loop --------------------------------------------------------------------

    def start_in_hub(self, hub: Any) -> None:
        """Subscribe, and read the subscription whenever ``hub`` sees its socket readable."""
        self._hub = hub
        self._subscribe_in_hub()

    def _subscribe_in_hub(self) -> None:
        if self._closed:
            return
        try:
            pubsub = self._subscribed()
            fd = socket_fileno(pubsub.connection)
        except REDIS_ERRORS as exc:
            self._lost(exc)
            return
        self._pubsub, self._fd, self._failed = pubsub, fd, 0
        self._hub.add_reader(fd, self._on_readable)

    def _on_readable(self, *_: Any) -> None:
        pubsub = self._pubsub
        if pubsub is None:
            return
        try:
            while (message := pubsub.get_message(True, timeout=0.0)) is not None:
                self._hand_on(message)
        except REDIS_ERRORS as exc:
            self._lost(exc)

    # -- on gevent and eventlet ----------------------------------------------------------------

    def start_green(self, spawn: Callable[..., Any], call_soon: Callable[..., None]) -> None:
        """Listen in a greenlet made with ``spawn``; offers reach admission by ``call_soon``
        (the dispatcher greenlet's queue)."""
        spawn(self._listen_green, call_soon)

    def _listen_green(self, call_soon: Callable[..., None]) -> None:
        while not self._closed:
            try:
                pubsub = self._pubsub
                if pubsub is None:
                    pubsub = self._pubsub = self._subscribed()
                    self._failed = 0
                message = pubsub.get_message(True, timeout=RECONNECT_AFTER)
            except Exception as exc:  # (this greenlet must go on: a Redis error above all)
                time.sleep(self._lost(exc))  # (patched: this greenlet only)
                continue
            if message is not None:
                self._hand_on(message, call_soon)
        self._lost(ConnectionError("admission stopped"))

    # -- both ----------------------------------------------------------------------------------

    def _subscribed(self) -> Any:
        """A Pub/Sub subscribed to the channel, its confirmation read."""
        client: Any = self._client  # (redis-py's pubsub() is untyped)
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(self._name)
            deadline = time.monotonic() + 5.0
            while True:
                message = pubsub.get_message(timeout=0.1)
                if message is not None and message.get("type") == "subscribe":
                    break
                if time.monotonic() > deadline:
                    raise redis.TimeoutError(f"no confirmation of SUBSCRIBE {self._name}")
        except BaseException:
            pubsub.close()
            raise
        return pubsub

    def _hand_on(
        self, message: dict[str, Any], call_soon: Callable[..., None] | None = None
    ) -> None:
        if message.get("type") != "message":
            return
        data = message.get("data")
        permit_id = data.decode() if isinstance(data, bytes) else str(data)
        if call_soon is not None:
            call_soon(self._offered, permit_id)
            return
        try:
            self._offered(permit_id)
        except Exception:  # one task's wake-up must not stop the others
            logger.exception("celery_redsem: admission failed to act on the offer to %s", permit_id)

    def _lost(self, exc: BaseException) -> float:
        """Drop the subscription (asks give no channel meanwhile); open it again later: the
        seconds until then (the event loop's timer does it; a greenlet sleeps them)."""
        pubsub, fd = self._pubsub, self._fd
        self._pubsub = self._fd = None
        if fd is not None and self._hub is not None:
            try:
                self._hub.remove_reader(fd)
            except Exception:  # the hub is closing
                logger.debug(
                    "celery_redsem: could not unregister the offers' socket", exc_info=True
                )
        if pubsub is not None:
            try:
                pubsub.close()
            except Exception:
                logger.debug("celery_redsem: could not close the offers' Pub/Sub", exc_info=True)
        if self._closed:
            return 0.0
        delay: float = min(RECONNECT_AT_MOST, RECONNECT_AFTER * 2.0**self._failed)
        self._failed += 1
        if pubsub is not None or self._failed == 1:  # (not once per try of an outage)
            logger.warning(
                "celery_redsem: the channel for fair-share offers was lost (%s); parked tasks "
                "of grouped semaphores wait for their timers until it is back (next try in "
                "%.0fs, then less often)",
                exc,
                delay,
            )
        if self._hub is not None:
            self._hub.call_later(delay, self._subscribe_in_hub)
        return delay

    def close(self) -> None:
        """Stop listening (the worker stops; a greenlet listening stops within a second)."""
        self._closed = True
        if self._hub is not None:
            self._lost(ConnectionError("admission stopped"))


class Offers:
    """Admission's side of the offers: which channel an ask gives, which semaphores' parked
    tasks are woken by offers (not by runs ending here), and offers that came for a task
    whose ask was still in flight (it is woken as soon as it is parked)."""

    def __init__(self) -> None:
        self._wakes: FairWakes | None = None
        # Grouped semaphores asked for with the channel, the latest last (at most _MAX_NAMES:
        # a name asked for long ago has its parked tasks woken as any semaphore's are).
        self._names: OrderedDict[str, None] = OrderedDict()
        self._early: dict[str, float] = {}  # permit id -> when its offer came (monotonic)
        self._lot: Any = None

    def start(self, client: object, prefix: str, lot: Any, *, hub: Any, green: Any) -> None:
        """Listen for offers (with an event loop ``hub``, or a ``green`` loop), if ``client``
        can; an offer wakes the task parked in admission's parking ``lot`` under its permit
        id."""
        if self._wakes is not None or lot is None or (hub is None) == (green is None):
            return
        if not FairWakes.usable(client):
            return
        assert isinstance(client, redis.Redis)
        self._lot = lot
        self._wakes = FairWakes(client, prefix, self._offered)
        if hub is not None:
            self._wakes.start_in_hub(hub)
        else:
            self._wakes.start_green(green.spawn, green.call_soon)

    def notify_for(self, sem: Any) -> str | None:
        """The channel an ask for ``sem`` gives (None: none, ``sem`` is not grouped or no
        channel is listened to now)."""
        channel = self._wakes.channel if self._wakes is not None else None
        if channel is None or getattr(sem, "group", None) is None:
            return None
        names = self._names
        names[sem.name] = None
        names.move_to_end(sem.name)
        if len(names) > _MAX_NAMES:
            names.popitem(last=False)
        return channel

    def wake_by_offers(self, name: str) -> bool:
        """Whether the tasks parked on ``name`` are woken by offers: a run of it ending here
        wakes none of them (its permit goes to the next in fair order, wherever parked)."""
        return name in self._names and self._wakes is not None and self._wakes.channel is not None

    def parked(self, run: str, parked: Any) -> None:
        """``parked`` was just parked for ``run`` (permit id): woken at once if an offer for
        it came while its ask was in flight."""
        came = self._early.pop(run, None)
        if came is not None and time.monotonic() - came < OFFER_SECONDS:
            self._lot.wake(parked)

    def _offered(self, permit_id: str) -> None:
        parked = self._lot.tasks.in_line(permit_id)
        if parked is not None:
            self._lot.wake(parked)
            return
        now = time.monotonic()
        if len(self._early) > 1000:  # (offers to tasks not parked here, nor asking: dropped)
            self._early = {k: t for k, t in self._early.items() if now - t < OFFER_SECONDS}
        self._early[permit_id] = now

    def close(self) -> None:
        """Stop listening."""
        if self._wakes is not None:
            self._wakes.close()
