"""The Celery app, configured from Django's settings (every ``CELERY_*`` name)."""

import os

from celery import Celery

from . import metrics  # noqa: F401  (Prometheus metrics, if REDSEM_METRICS_PORT is set)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")

# CELERY_BROKER_URL -> broker_url, CELERY_REDSEM_LEASE -> redsem_lease, ...
app.config_from_object("django.conf:settings", namespace="CELERY")

# Finds market/tasks.py (and tasks.py in every other installed app).
app.autodiscover_tasks()
