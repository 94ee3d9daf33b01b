"""The signals celery_redsem sends (:data:`task_skipped`); importing this imports Celery."""

from __future__ import annotations

from celery_redsem.integration.signals import task_skipped

__all__ = ["task_skipped"]
