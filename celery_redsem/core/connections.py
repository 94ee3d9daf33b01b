"""The one module that reaches past redis-py's public API: what the package does with a
connection beyond sending commands on it.

* :func:`check_out`: a connection from a pool, for a caller that sends on it itself (redis-py
  before 5.3 wants a command name there; later versions take none).
* :func:`is_open`: whether a connection has its socket (redis-py 5.1 and later spell this
  ``is_connected``; 5.0 lacks it).
* :func:`socket_fileno`: the file descriptor of an open connection's socket, for an event loop
  to watch.
* :func:`native_twin`: a client of the same server for an OS thread of a gevent or eventlet
  process, whose sockets and locks are the OS's (see :mod:`~celery_redsem.core.native`).
"""

from __future__ import annotations

import socket
import weakref
from typing import Any

import redis
from redis._parsers import _RESP2Parser
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redsem.core import native

__all__ = ["check_out", "is_open", "native_twin", "socket_fileno"]


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
    ``getaddrinfo``)."""

    def _connect(self) -> Any:
        original = _original_socket()
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


def _original_socket() -> Any:
    library = native.green_library()
    if library == "gevent":
        from gevent.monkey import get_original

        return _Socket(*get_original("socket", ["socket", "getaddrinfo"]))
    if library == "eventlet":
        from eventlet.patcher import original

        return original("socket")
    return socket


class _Socket:
    def __init__(self, socket_class: Any, getaddrinfo: Any) -> None:
        self.socket, self.getaddrinfo = socket_class, getaddrinfo


_twins: weakref.WeakKeyDictionary[Any, redis.Redis] = weakref.WeakKeyDictionary()


def native_twin(client: Any) -> redis.Redis | None:
    """A client of ``client``'s server for an OS thread in a green process: its own pool of
    connections with the OS's sockets and locks, redis-py's Python parser (hiredis polls with
    ``select``, which the green libraries patch) and no retry (its back-off sleeps greenly);
    one per client. None for a client it cannot mirror (a cluster, Sentinel, TLS or a Unix
    socket, a class of its own)."""
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
    twin_pool = redis.ConnectionPool(connection_class=_NativeConnection, **kwargs)
    twin_pool._lock = native.rlock()
    twin_pool._fork_lock = native.rlock()
    dispatcher = getattr(twin_pool, "_event_dispatcher", None)
    if dispatcher is not None and hasattr(dispatcher, "_lock"):
        dispatcher._lock = native.rlock()
    twin = redis.Redis(connection_pool=twin_pool)
    _twins[client] = twin
    return twin
