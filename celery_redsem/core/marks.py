"""De-duplication marks: which task run a semaphore name is queued or running for.

A :class:`DedupeMark` is one hash next to the semaphore's keys (same hash tag), written only by
``dedupe.lua``, so that taking it is one atomic call: two senders at once never both get it.
While its run is queued the mark lives for its TTL; once the run holds its permit
(:meth:`DedupeMark.hold`) it lives only as long as that permit does, so a run whose worker was
lost frees the name when its lease ends, not when the TTL does; the run renews the TTL
(:meth:`DedupeMark.keep`) while it goes on, so a run longer than the TTL keeps its mark.

A :class:`CoalesceRecord` (``dedupe="coalesce"``, ``debounce=``) lives in the same hash,
written only by ``coalesce.lua``: the running run, as a mark is, and at most one pending run
with the newest arguments of the sends it absorbed (see that script's header).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_redsem.core.client import RedisClient, to_ms
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.scripts import COALESCE, DEDUPE, as_text, run_script
from celery_redsem.core.validation import SECONDS, validate_name, validate_prefix

__all__ = ["Arguments", "CoalesceRecord", "CoalesceState", "Debounce", "Decision", "DedupeMark"]


class _KeyRecord:
    """What a semaphore ``name`` (under ``prefix``) keeps per key beside its permits, in its
    dedupe hash (with its holders hash, under the same hash tag), on ``client``."""

    def __init__(self, client: RedisClient, name: str, *, prefix: str) -> None:
        self.client = client
        self.name = validate_name(name)
        keys = SemaphoreKeys(validate_prefix(prefix), self.name)
        self._keys = [keys.dedupe, keys.holders]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class DedupeMark(_KeyRecord):
    """The de-duplication mark of semaphore ``name`` (under ``prefix``) on ``client``."""

    def take(self, task_id: str, ttl: float) -> str:
        """Mark the name for ``task_id`` for ``ttl`` seconds unless another live run has it:
        the task id the name is marked for (``task_id`` itself if it got the mark)."""
        return self._decide("take", task_id, ttl)

    def claim(self, task_id: str, ttl: float) -> str:
        """As :meth:`take`, but a mark that is ``task_id``'s already is left as it is (a
        message reaching a worker, a run starting: a copy of a running run must not make
        its mark look queued)."""
        return self._decide("claim", task_id, ttl)

    def hold(self, task_id: str, permit_id: str, ttl: float) -> None:
        """Mark the name for ``task_id``, running under ``permit_id`` (live while it holds it)."""
        self._run("hold", task_id, _ms(ttl), permit_id)

    def keep(self, task_id: str, permit_id: str, ttl: float) -> bool:
        """Make the mark of ``task_id``, running under ``permit_id``, live ``ttl`` seconds
        more; False if the mark is no longer that."""
        return int(self._run("keep", task_id, _ms(ttl), permit_id)) == 1

    def clear(self, task_id: str) -> bool:
        """Remove the mark if it is ``task_id``'s; whether it was."""
        return int(self._run("clear", task_id)) == 1

    def _decide(self, op: str, task_id: str, ttl: float) -> str:
        reply = self._run(op, task_id, _ms(ttl))
        return as_text(reply) if isinstance(reply, bytes | str) else str(reply)

    def _run(self, *args: object) -> bytes | str | int:
        reply: bytes | str | int = run_script(
            DEDUPE, self.client, self._keys, list(args), self.name
        )
        return reply


def _ms(ttl: float) -> int:
    return to_ms(SECONDS.check(ttl, "dedupe ttl"))


@dataclass(frozen=True)
class Arguments:
    """A call's arguments serialized as Celery serializes a message body."""

    data: bytes
    content_type: str
    content_encoding: str


@dataclass(frozen=True)
class Debounce:
    """Debounce of a coalesced name, in seconds: a run starts ``wait`` after the newest send,
    but no later than ``most`` (0: no bound) after the first one it answers for."""

    wait: float = 0.0
    most: float = 0.0

    def ms(self) -> list[int]:
        return [to_ms(self.wait) if self.wait else 0, to_ms(self.most) if self.most else 0]


@dataclass(frozen=True)
class Decision:
    """What ``coalesce.lua`` decided: ``status`` (see the script's header), the run ``task_id``
    it names, ``delay`` in seconds (a deferral, a wait, a debounced send's countdown), and
    for a run that starts its newest ``arguments`` (None: its own) and the ids it ``answers``
    for."""

    status: str
    task_id: str = ""
    delay: float = 0.0
    arguments: Arguments | None = None
    answers: tuple[str, ...] = ()


@dataclass(frozen=True)
class CoalesceState:
    """The coalesce record of a name: the running run (and whether its lease is live), the
    live pending run, seconds until it is due, and how many sends it answers for."""

    running: str | None
    running_live: bool
    pending: str | None
    due_in: float
    answers: int


class CoalesceRecord(_KeyRecord):
    """The newest-wins record of semaphore ``name`` (``dedupe="coalesce"``): its running run
    and at most one pending run with the newest arguments, kept by ``coalesce.lua``."""

    def send(
        self, task_id: str, arguments: Arguments, ttl: float, debounce: Debounce, *, own_id: bool
    ) -> Decision:
        """A send: ``absorbed`` by the live pending run, or ``publish`` as the pending run
        (``own_id``: the send's id is answered for too)."""
        return self._decide("send", task_id, ttl, arguments, debounce, flag=own_id)

    def receive(
        self, task_id: str, arguments: Arguments, ttl: float, debounce: Debounce, *, canvas: bool
    ) -> Decision:
        """A message reached a worker: ``known``, ``pending``, ``absorbed``, ``took`` or
        ``queued``."""
        return self._decide("receive", task_id, ttl, arguments, debounce, flag=canvas)

    def start(
        self,
        task_id: str,
        permit_id: str,
        arguments: Arguments,
        ttl: float,
        debounce: Debounce,
        *,
        canvas: bool,
    ) -> Decision:
        """The run holds its permit: ``run``, ``defer``, ``wait`` or ``absorbed``."""
        return self._decide(
            "start", task_id, ttl, arguments, debounce, flag=canvas, permit_id=permit_id
        )

    def keep(self, task_id: str, permit_id: str, ttl: float) -> bool:
        """Keep the record ``ttl`` seconds more while ``task_id`` runs under ``permit_id``."""
        return int(self._run("keep", task_id, _ms(ttl), permit_id)) == 1

    def finish(self, task_id: str) -> list[str]:
        """The run ``task_id`` ended: the ids whose results are its result."""
        return [as_text(i) for i in self._run("finish", task_id)]

    def clear(self, task_id: str) -> bool:
        """As :meth:`finish`, for the keeper's interface; whether it answered for any."""
        return bool(self.finish(task_id))

    def state(self) -> CoalesceState:
        running, live, pending, due_ms, answers = self._run("state", "")
        return CoalesceState(
            as_text(running) if running else None,
            int(live) == 1,
            as_text(pending) if pending else None,
            int(due_ms) / 1000,
            int(answers),
        )

    def _decide(
        self,
        op: str,
        task_id: str,
        ttl: float,
        arguments: Arguments,
        debounce: Debounce,
        *,
        flag: bool,
        permit_id: str = "",
    ) -> Decision:
        reply: Any = self._run(
            op,
            task_id,
            _ms(ttl),
            arguments.data,
            arguments.content_type,
            arguments.content_encoding,
            *debounce.ms(),
            "1" if flag else "0",
            permit_id,
        )
        status = as_text(reply[0])
        if status == "run":
            data, ctype, cenc = reply[1:4]
            newest = Arguments(_bytes(data), as_text(ctype), as_text(cenc)) if data else None
            answers = tuple(as_text(i) for i in reply[4:])
            return Decision(status, task_id, arguments=newest, answers=answers)
        delay = int(reply[2]) / 1000 if len(reply) > 2 else 0.0  # (send)
        if status in ("defer", "wait"):
            return Decision(status, task_id, int(reply[1]) / 1000)
        return Decision(status, as_text(reply[1]), delay)

    def _run(self, *args: object) -> Any:
        return run_script(COALESCE, self.client, self._keys, list(args), self.name)


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
