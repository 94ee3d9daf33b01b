"""The Celery apps and task modules the integration tests run in workers (not tests)."""
