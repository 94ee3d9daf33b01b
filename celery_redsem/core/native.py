"""Real OS threads and locks, also in a process that gevent or eventlet has monkey-patched.

Under ``gevent.monkey.patch_all()`` or ``eventlet.monkey_patch()`` (Celery's ``-P gevent`` and
``-P eventlet`` workers), ``threading.Thread`` makes a greenlet and ``threading.Lock`` a green
lock: a thread of the heartbeat would then run only when the task's greenlet yields, and a body
that computes for longer than a lease without yielding would lose its permit while it runs.
This module hands out the originals the green libraries saved, so the heartbeat's threads are
OS threads that run whatever the greenlets do. In any other process they are the usual ones.

Work a native thread must not do itself under eventlet (logging, a loss listener: anything that
may take a green lock a greenlet holds) goes to the main thread's green hub with
:func:`in_green`, which also interrupts a greenlet (:func:`throw_into`).
"""

from __future__ import annotations

import _queue
import _thread
import collections
import contextlib
import logging
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "NativeThread",
    "Wake",
    "allocate_lock",
    "current_greenlet",
    "green_library",
    "in_green",
    "original_socket",
    "prepare_green",
    "rlock",
    "spawn_green",
    "start_thread",
    "throw_into",
]

logger = logging.getLogger(__name__)


def green_library() -> str | None:
    """``"gevent"`` or ``"eventlet"`` if that library monkey-patched threads in this process."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None


class _Originals(NamedTuple):
    start_new_thread: Callable[..., Any]
    allocate_lock: Callable[[], Any]


def _original_thread_module() -> Any:
    library = green_library()
    if library == "gevent":
        from gevent.monkey import get_original

        start, lock = get_original("_thread", ["start_new_thread", "allocate_lock"])
        return _Originals(start, lock)
    if library == "eventlet":
        from eventlet.patcher import original

        return original("_thread")
    return _thread


def allocate_lock() -> Any:
    """A lock that blocks the OS thread (not a green lock)."""
    return _original_thread_module().allocate_lock()


def rlock() -> Any:
    """A re-entrant lock that blocks the OS thread (not a green lock)."""
    library = green_library()
    if library == "eventlet":
        from eventlet.patcher import original

        return original("threading").RLock()
    return _thread.RLock()  # (gevent leaves the C RLock alone)


def original_socket() -> Any:
    """The ``socket`` module as it was before the green library patched it (its ``socket``
    and ``getaddrinfo``: what a connection of an OS thread needs)."""
    library = green_library()
    if library == "gevent":
        from gevent.monkey import get_original

        return _Socket(*get_original("socket", ["socket", "getaddrinfo"]))
    if library == "eventlet":
        from eventlet.patcher import original

        return original("socket")
    return socket


class _Socket(NamedTuple):
    socket: Any
    getaddrinfo: Callable[..., Any]


def spawn_green(fn: Callable[..., Any], *args: Any) -> None:
    """Start ``fn(*args)`` in a new greenlet (call it in the hub: see :func:`in_green`)."""
    if green_library() == "gevent":
        import gevent

        gevent.spawn(fn, *args)
    else:
        import eventlet

        eventlet.spawn(fn, *args)


class NativeThread:
    """An OS thread started by :func:`start_thread`: whether it runs, and a join."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self.name = name
        self._target = target
        self._done = allocate_lock()
        self._done.acquire()
        self._ident: int | None = None

    def _run(self) -> None:
        try:
            self._target()
        finally:
            self._done.release()

    def is_alive(self) -> bool:
        """Whether the thread has not ended yet."""
        if self._done.acquire(False):
            self._done.release()
            return False
        return True

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (up to ``timeout`` seconds)."""
        if self._done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._done.release()


def start_thread(target: Callable[[], None], name: str) -> Any:
    """Run ``target()`` in a new daemon OS thread; the thread (``is_alive()``, ``join()``)."""
    if green_library() is None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread
    native_thread = NativeThread(target, name)
    _original_thread_module().start_new_thread(native_thread._run, ())
    return native_thread


class Wake:
    """A wake-up call between OS threads (what ``threading.Event`` is for the heartbeat): set
    from any thread or greenlet without blocking, waited on by an OS thread."""

    def __init__(self) -> None:
        self._calls: Any = _queue.SimpleQueue()  # (C-level: never green)

    def set(self) -> None:
        """Wake the waiter (now, or at its next wait)."""
        self._calls.put(None)

    def clear(self) -> None:
        """Forget the calls made so far."""
        while True:
            try:
                self._calls.get_nowait()
            except _queue.Empty:
                return

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a call; whether one came."""
        try:
            self._calls.get(timeout=max(0.0, timeout))
        except _queue.Empty:
            return False
        return True


def current_greenlet() -> Any:
    """The greenlet running now in a green process (None in any other)."""
    library = green_library()
    if library == "gevent":
        import gevent

        return gevent.getcurrent()
    if library == "eventlet":
        from eventlet import greenthread

        return greenthread.getcurrent()
    return None


def prepare_green() -> None:
    """Ready :func:`in_green` for the OS threads (call it from a greenlet of the main thread,
    whose hub is the one to reach; it does nothing in a process that is not green, and nothing
    after its first call)."""
    library = green_library()
    if library is None or library in _hub:
        return
    if library == "gevent":
        import gevent

        _hub["gevent"] = gevent.get_hub()
    else:
        _hub["eventlet"] = _EventletWaker()


def in_green(fn: Callable[..., Any], *args: Any) -> None:
    """From an OS thread: run ``fn(*args)`` in the main thread's green hub, readied by
    :func:`prepare_green` (at once, in the calling thread, in a process that is not green or
    where nothing readied it)."""
    library = green_library()
    hub = _hub.get(library) if library is not None else None
    if hub is None:
        fn(*args)
    elif library == "gevent":
        hub.loop.run_callback_threadsafe(fn, *args)
    else:
        hub.call(fn, *args)


def throw_into(greenlet: Any, exc: BaseException, still_wanted: Callable[[], bool]) -> None:
    """From an OS thread: raise ``exc`` in ``greenlet`` at its next yield, if by then
    ``still_wanted()`` (checked in the hub: a body that ended meanwhile is left alone)."""

    def throw() -> None:
        if still_wanted() and not greenlet.dead:
            greenlet.throw(exc)

    in_green(throw)


#: The main thread's gevent hub, or the eventlet waker in it (see prepare_green).
_hub: dict[str, Any] = {}


class _EventletWaker:
    """A greenthread in the main thread's eventlet hub that runs what OS threads hand it:
    eventlet's hub has no thread-safe way in, so they write a byte to a socket it reads."""

    def __init__(self) -> None:
        import eventlet
        import eventlet.greenio
        from eventlet.patcher import original

        read, self._write = original("socket").socketpair()
        self._write.setblocking(False)
        self._read = eventlet.greenio.GreenSocket(read)
        self._calls: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        eventlet.spawn(self._serve)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self._calls.append((fn, args))  # (deque: safe across threads)
        with contextlib.suppress(BlockingIOError):  # (full: it has plenty to read already)
            self._write.send(b"\0")

    def _serve(self) -> None:
        while True:
            self._read.recv(4096)
            while self._calls:
                fn, args = self._calls.popleft()
                try:
                    fn(*args)
                except Exception:  # (a call's failure is its own; the waker goes on)
                    logger.exception("celery_redsem: a call handed to the green hub failed")
