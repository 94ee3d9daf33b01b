"""Admission at dispatch, in a worker's main process: a guarded task takes a pool slot only
once it has its permit; one that cannot run soon is parked, unacknowledged, and woken by a
release. Everything it touches of Celery's and kombu's private API goes through
:mod:`celery_redsem.integration.seam`."""
