"""De-duplication marks: which task run a semaphore name is queued or running for.

A :class:`DedupeMark` is one hash next to the semaphore's keys (same hash tag), written only by
``dedupe.lua``, so that taking it is one atomic call: two senders at once never both get it.
While its run is queued the mark lives for its TTL; once the run holds its permit
(:meth:`DedupeMark.hold`) it lives only as long as that permit does, so a run whose worker was
lost frees the name when its lease ends, not when the TTL does; the run renews the TTL
(:meth:`DedupeMark.keep`) while it goes on, so a run longer than the TTL keeps its mark.
"""

from __future__ import annotations

from celery_redsem.core.client import RedisClient, to_ms
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.scripts import DEDUPE, as_text, run_script
from celery_redsem.core.validation import SECONDS, validate_name, validate_prefix

__all__ = ["DedupeMark"]


class DedupeMark:
    """The de-duplication mark of semaphore ``name`` (under ``prefix``) on ``client``."""

    def __init__(self, client: RedisClient, name: str, *, prefix: str) -> None:
        self.client = client
        self.name = validate_name(name)
        keys = SemaphoreKeys(validate_prefix(prefix), self.name)
        self._keys = [keys.dedupe, keys.holders]

    def __repr__(self) -> str:
        return f"<DedupeMark {self.name!r}>"

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
