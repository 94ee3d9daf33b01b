"""The app of :mod:`.worker_app`, run by a worker whose slot semaphore keeps its queue under
another name than kombu's ``_waiting`` (:class:`.renamed_slots.RenamedSlots`): what admission
relies on is not there, so it must stay off, with one warning. (Only a worker subprocess may
import this: it changes what Celery's Pool step builds, process-wide.)"""

from __future__ import annotations

import celery.worker.components as components

from tests.integration.apps.renamed_slots import RenamedSlots

components.LaxBoundedSemaphore = RenamedSlots  # type: ignore[misc]  # what the Pool step makes

from tests.integration.apps.worker_app import app  # noqa: E402

__all__ = ["app"]
