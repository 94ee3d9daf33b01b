"""The Django project. Importing it loads the Celery app, so ``@shared_task`` uses it."""

from .celery import app as celery_app

__all__ = ("celery_app",)
