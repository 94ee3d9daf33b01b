"""The one module that reaches past redis-py's public API: what the package does with a
connection beyond sending commands on it.

* :func:`check_out`: a connection from a pool, for a caller that sends on it itself (redis-py
  before 5.3 wants a command name there; later versions take none).
* :func:`is_open`: whether a connection has its socket (redis-py 5.1 and later spell this
  ``is_connected``; 5.0 lacks it).
* :func:`socket_fileno`: the file descriptor of an open connection's socket, for an event loop
  to watch.
* :func:`native_twin`: a client of the same server for an OS thread of a gevent or eventlet
  process, whose sockets and locks are the OS's (given by :mod:`~celery_redsem.core.native`).
* :func:`error_code`: the code of a Redis error reply (``ERR``, ``WRONGTYPE``, ``OOM``...):
  redis-py 7.2 and later keep it as ``status_code``; before, its parser drops a code it knows
  (``ERR`` among them) and leaves the others at the start of the message.

It imports nothing of the package, so that :mod:`~celery_redsem.core.errors` can use it.
"""

from __future__ import annotations

import re
import socket
import weakref
from collections.abc import Callable
from typing import Any

import redis
from redis._parsers import _RESP2Parser
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

__all__ = ["check_out", "error_code", "is_open", "native_twin", "socket_fileno"]


def check_out(pool: Any) -> Any:
    """A connection from redis-py connection ``pool`` (give it back with ``pool.release``)."""
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3: the command name is required (and unused)
        return pool.get_connection("_")


def is_open(connection: Any) -> bool:
    """Whether ``connection`` has an open socket."""
    return getattr(connection, "_sock", None) is not None


def socket_fileno(connection: Any) -> int:
    """The file descriptor of the open ``connection``'s socket."""
    fileno: int = connection._sock.fileno()
    return fileno


class _NativeConnection(redis.Connection):
    """A TCP connection whose socket is the one the green library saved before it patched
    ``socket`` (redis-py's own ``_connect``, with the original ``socket`` and
    ``getaddrinfo``, which :func:`native_twin` puts in ``sockets``)."""

    sockets: Any = socket

    def _connect(self) -> Any:
        original = self.sockets
        error: OSError | None = None
        for family, kind, proto, _name, address in original.getaddrinfo(
            self.host, self.port, self.socket_type, socket.SOCK_STREAM
        ):
            sock = None
            try:
                sock = original.socket(family, kind, proto)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.socket_keepalive:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    for option, value in self.socket_keepalive_options.items():
                        sock.setsockopt(socket.IPPROTO_TCP, option, value)
                sock.settimeout(self.socket_connect_timeout)
                sock.connect(address)
                sock.settimeout(self.socket_timeout)
                return sock
            except OSError as exc:
                error = exc
                if sock is not None:
                    sock.close()
        raise error if error is not None else OSError("getaddrinfo returned an empty list")


_twins: weakref.WeakKeyDictionary[Any, redis.Redis] = weakref.WeakKeyDictionary()


def native_twin(client: Any, *, sockets: Any, rlock: Callable[[], Any]) -> redis.Redis | None:
    """A client of ``client``'s server for an OS thread in a green process: its own pool of
    connections with the OS's sockets (``sockets``: a ``socket`` module, or an object with its
    ``socket`` and ``getaddrinfo``) and locks (``rlock()``), redis-py's Python parser (hiredis
    polls with ``select``, which the green libraries patch) and no retry (its back-off sleeps
    greenly); one per client. None for a client it cannot mirror (a cluster, Sentinel, TLS or
    a Unix socket, a class of its own)."""
    twin = _twins.get(client)
    if twin is not None:
        return twin
    pool = getattr(client, "connection_pool", None)
    if (
        type(client) is not redis.Redis
        or type(pool) is not redis.ConnectionPool
        or pool.connection_class is not redis.Connection
    ):
        return None
    kwargs = {**pool.connection_kwargs, "parser_class": _RESP2Parser}
    kwargs["retry"] = Retry(NoBackoff(), 0)
    connection_class = type("_NativeConnection", (_NativeConnection,), {"sockets": sockets})
    twin_pool = redis.ConnectionPool(connection_class=connection_class, **kwargs)
    twin_pool._lock = rlock()
    twin_pool._fork_lock = rlock()
    dispatcher = getattr(twin_pool, "_event_dispatcher", None)
    if dispatcher is not None and hasattr(dispatcher, "_lock"):
        dispatcher._lock = rlock()
    twin = redis.Redis(connection_pool=twin_pool)
    _twins[client] = twin
    return twin


#: How redis-py's pipeline annotates an error of one of its commands.
_PIPELINE_NOTE = re.compile(r"Command # \d+ \(.*\) of pipeline caused error: ", re.DOTALL)
#: An error code: the upper-case word an error reply starts with.
_CODE = re.compile(r"[A-Z][A-Z0-9_-]*(?= |$)")


def error_code(error: BaseException) -> str | None:
    """The code of the Redis error reply ``error`` was made of (``"ERR"``, ``"WRONGTYPE"``,
    ``"BUSY"``...), or None if it is no plain reply or its code is not known.

    redis-py 7.2 and later keep the code as ``status_code``, and leave an unknown one in the
    message. Before, a code its parser knows is dropped and named only by the exception's
    class (``OOM``: ``OutOfMemoryError``...), except ``ERR``, which gives a plain
    ``ResponseError``; any other stays at the start of the message. So, for a plain
    ``ResponseError``: an upper-case first word is the code, and a message that starts
    otherwise was an ``ERR`` reply (``user_script:1: ...``, ``unknown command ...``). The
    reading can be wrong for an ``ERR`` reply whose text starts with an upper-case command
    name (``ERR EXEC without MULTI``): that reads as a code not known, which errs on the side
    of retrying.
    """
    code = getattr(error, "status_code", None)
    if isinstance(code, str) and code:
        return code
    if not isinstance(error, ResponseError):
        return None
    message = str(error.args[0]) if error.args else ""
    note = _PIPELINE_NOTE.match(message)
    if note:
        message = message[note.end() :]
    found = _CODE.match(message)
    if found:
        return found.group()
    if type(error) is ResponseError and not hasattr(error, "status_code"):
        return "ERR"  # (redis-py < 7.2 dropped it)
    return None
