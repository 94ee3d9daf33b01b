"""Every field the worker's main process, or a contention retry, writes for the run that follows.

A run learns four things from outside its own arguments, and each travels in one field that
only this module reads and writes:

==========================  =====================================================================
field                       what it says
==========================  =====================================================================
:data:`GRANT_FIELD`         admission granted this run's permit (with a secret: see below)
:data:`STANDBY_FIELD`       the run waits in its slot as its semaphore's standby
:data:`DUPLICATE_FIELD`     another run had the dedupe mark when this message reached the worker
:data:`WAIT_HEADER`         where the run stands in its wait for a permit (:class:`WaitState`),
                            across contention retries (a message header)
==========================  =====================================================================

The first three are one-shot: the main process sets them on the request it hands to the pool
(removing stale ones first), and the run takes them with :func:`take_field`, which also removes
Celery's copy in the request's headers, so that no retry's message carries them on.

A grant carries a secret drawn in the main process before the pool forks: children inherit it,
nobody else knows it, so a message header cannot forge a grant.

A standby's child tells the main process when it got its permit through a pipe
(:func:`tell_granted`); the main process then acknowledges its message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any, NamedTuple

from celery import current_task
from celery.app.task import Context

from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit

__all__ = [
    "DUPLICATE_FIELD",
    "GRANT_FIELD",
    "STANDBY_FIELD",
    "WAIT_HEADER",
    "WaitState",
    "clear_dispatch_fields",
    "contention_retries",
    "hand_over",
    "headers_with_wait",
    "mark_duplicate",
    "mark_standby",
    "open_grant_notices",
    "read_wait",
    "read_wait_of",
    "stamp_wait",
    "stamp_wait_began",
    "take_duplicate_of",
    "take_field",
    "take_grant",
    "take_standby",
    "tell_granted",
]

logger = logging.getLogger(__name__)

#: Field of the request dict that carries a handed-over grant to the pool child.
GRANT_FIELD = "redsem_grant"
#: Field of the request dict that tells a pool child its task is a standby.
STANDBY_FIELD = "redsem_standby"
#: Field of a request that the worker's main process sets, to the id of the run that has the
#: dedupe mark, when the message reached it while another live run had the mark.
DUPLICATE_FIELD = "redsem_duplicate_of"
#: Message header carrying a :class:`WaitState` (and the task's own retry count).
WAIT_HEADER = "redsem_wait"

_SECRET = os.urandom(16).hex()
#: Highest retry count read from a ``redsem_wait`` header.
_MAX_COUNT = 64


def take_field(request: Any, name: str) -> Any:
    """The one-shot field ``name`` of a run's request (None if it has none), removed from the
    request and from its headers (Celery copies unknown fields there, and ``self.retry()``
    would publish them)."""
    value = getattr(request, name, None)
    with suppress(AttributeError):
        delattr(request, name)
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        headers.pop(name, None)
    return value


def clear_dispatch_fields(request_dict: dict[str, Any]) -> None:
    """Remove the grant and standby fields from a request before admission decides afresh."""
    request_dict.pop(GRANT_FIELD, None)
    request_dict.pop(STANDBY_FIELD, None)


# -- a grant handed over ---------------------------------------------------------------------------


def hand_over(request_dict: dict[str, Any], permit: Permit, granted_at: float) -> None:
    """Put ``permit`` (granted at monotonic time ``granted_at``) in a request for its child."""
    request_dict[GRANT_FIELD] = [
        _SECRET,
        permit.id,
        permit.name,
        permit.prefix,
        permit.token,
        permit.expires_at,
        granted_at,
    ]


def take_grant(request: Any, name: str, prefix: str, lease: float) -> tuple[Permit, float] | None:
    """The permit handed over for this run of ``request`` on semaphore ``name``, with the
    monotonic time it was granted; None if there is none (or it is not for this semaphore)."""
    value = take_field(request, GRANT_FIELD)
    if not isinstance(value, list | tuple) or len(value) != 7:
        return None
    secret, permit_id, granted_name, granted_prefix, token, expires_at, granted_at = value
    if (
        secret != _SECRET
        or permit_id != permit_id_of(request)
        or granted_name != name
        or granted_prefix != prefix
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in (token, expires_at))
        or not isinstance(granted_at, float)
    ):
        return None
    return Permit(permit_id, name, token, expires_at, lease, prefix), granted_at


def has_grant(request: Any) -> bool:
    """Whether ``request`` carries a grant (not taken yet)."""
    return getattr(request, GRANT_FIELD, None) is not None


# -- a standby -------------------------------------------------------------------------------------


def mark_standby(request_dict: dict[str, Any]) -> None:
    """Tell the child that the task in ``request_dict`` is a standby."""
    request_dict[STANDBY_FIELD] = True


def take_standby(request: Any) -> bool:
    """In the child: whether this run is a standby."""
    return take_field(request, STANDBY_FIELD) is True


#: The write end of the grant notices' pipe, under "fd" (made in the main process before the
#: pool forks its children, which inherit it), or under "local" what a task's greenlet calls;
#: empty outside a worker with admission.
_notice: dict[str, Any] = {}


def open_grant_notices(local: Callable[[str], None] | None = None) -> int | None:
    """Open the pipe on which standbys' children tell of their grants; its read end. With
    ``local``: runs in this process tell it instead (no pipe)."""
    if local is not None:
        _notice["local"] = local
        return None
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    _notice["fd"] = write_fd
    return read_fd


def tell_granted(task_id: str) -> None:
    """In a standby's run: it got its permit; the worker acknowledges its message."""
    local = _notice.get("local")
    if local is not None:
        local(task_id)
        return
    fd = _notice.get("fd")
    if fd is None:
        return
    try:  # (non-blocking: if the pipe is full, the message is acknowledged when the run ends)
        os.write(fd, task_id.encode() + b"\n")
    except OSError as exc:
        logger.debug("celery_redsem: could not tell the main process of a grant: %s", exc)


# -- a duplicate -----------------------------------------------------------------------------------


def mark_duplicate(request_dict: dict[str, Any], holder: str | None) -> None:
    """Say (``holder``: the run with the mark) or unsay (None) that a request is a duplicate."""
    if holder is None:
        request_dict.pop(DUPLICATE_FIELD, None)
    else:
        request_dict[DUPLICATE_FIELD] = holder


def take_duplicate_of(request: Any) -> str | None:
    """The run the worker's main process found to have the mark as this run's message reached
    it, if it found one."""
    value = take_field(request, DUPLICATE_FIELD)
    return value if isinstance(value, str) and value else None


def is_duplicate(request_dict: Mapping[str, Any]) -> bool:
    """Whether the main process found the request a duplicate as it arrived."""
    return bool(request_dict.get(DUPLICATE_FIELD))


# -- the wait across contention retries ------------------------------------------------------------


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

    def _header(self, retries: int) -> list[int]:
        """The header value; ``retries`` (the task's own) tells a later own retry apart."""
        return [self.attempts, self.first_ms, retries, self.errors, self.due_ms, self.offline_ms]


def read_wait(request: Context) -> WaitState:
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


def read_wait_of(request_dict: dict[str, Any]) -> WaitState:
    """:func:`read_wait` for a worker request's dict (in the worker's main process)."""
    return read_wait(Context(request_dict))


def contention_retries(request: Any = None) -> int:
    """How many times this run of a guarded task went back through the broker to wait for its
    permit (contention retries, which never count toward ``max_retries``); ``request``: a task's
    ``self.request`` (default: the running task's)."""
    if request is None:
        request = getattr(current_task, "request", None)
    return read_wait(request).attempts if request is not None else 0


def headers_with_wait(request: Context, wait: WaitState) -> dict[str, Any]:
    """``request``'s headers with ``wait`` in them, for the message of its retry."""
    return {**(request.headers or {}), WAIT_HEADER: wait._header(request.retries)}


def stamp_wait(request_dict: dict[str, Any], wait: WaitState) -> None:
    """Put ``wait`` in a worker request's dict (and its headers), for the pool child."""
    value = wait._header(int(request_dict.get("retries") or 0))
    request_dict[WAIT_HEADER] = value
    headers = request_dict.get("headers")
    if isinstance(headers, Mapping):
        request_dict["headers"] = {**headers, WAIT_HEADER: value}


def stamp_wait_began(request_dict: dict[str, Any], first_ms: int) -> None:
    """Tell the child when the wait of a worker request began (server ms); it fails the task
    once ``max_wait`` is spent."""
    wait = read_wait_of(request_dict)
    stamp_wait(request_dict, WaitState(wait.attempts, first_ms, wait.errors, 0, 0))
