"""The Celery integration: decorators, settings, worker hooks, admission at dispatch."""
