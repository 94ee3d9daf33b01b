"""The celery_redsem example: a Django + Celery marketplace (see README.md in this folder)."""
