"""The Celery app, configured from Django's settings (every ``CELERY_*`` name)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")

# CELERY_BROKER_URL -> broker_url, CELERY_REDSEM_LEASE -> redsem_lease, ...
app.config_from_object("django.conf:settings", namespace="CELERY")

# Finds market/tasks.py (and tasks.py in every other installed app).
app.autodiscover_tasks()
