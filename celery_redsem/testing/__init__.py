"""Testing helpers for users' own suites: a real server and a configured Celery app.

The pytest plugin (:mod:`celery_redsem.testing.pytest_plugin`) loads by itself once
celery_redsem is installed; its fixtures are named ``redsem_*``. Nothing starts unless a test
asks for one of them.
"""
