"""The one module that reaches past redis-py's public API: what the package does with a
connection beyond sending commands on it.

* :func:`check_out`: a connection from a pool, for a caller that sends on it itself (redis-py
  before 5.3 wants a command name there; later versions take none).
* :func:`is_open`: whether a connection has its socket (redis-py 5.1 and later spell this
  ``is_connected``; 5.0 lacks it).
* :func:`socket_fileno`: the file descriptor of an open connection's socket, for an event loop
  to watch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_out", "is_open", "socket_fileno"]


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
