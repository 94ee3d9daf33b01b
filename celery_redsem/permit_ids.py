"""Permit ids that are unique across processes and cheap to make.

An id is this process's random 96-bit prefix followed by a counter in hex. Making one needs
no system call, which matters because the acquire path runs on every task start; a random
id per call (``os.urandom`` or ``uuid4``) costs a ``getrandom`` each time. A forked child
(a prefork pool worker) draws its own prefix before it runs anything, so parent and child
never hand out the same id.
"""

from __future__ import annotations

import itertools
import os

__all__ = ["new_permit_id"]


class _PermitIds:
    """The process's id prefix and counter; :meth:`draw` starts a new series."""

    def __init__(self) -> None:
        self.prefix = ""
        self.counter = itertools.count()
        self.draw()

    def draw(self) -> None:
        """Take a new random prefix and restart the counter (at import and after a fork)."""
        self.prefix = os.urandom(12).hex()
        self.counter = itertools.count()

    def next(self) -> str:
        """A permit id no other call, thread or process gets."""
        return self.prefix + format(next(self.counter), "x")


_IDS = _PermitIds()
os.register_at_fork(after_in_child=_IDS.draw)

new_permit_id = _IDS.next
