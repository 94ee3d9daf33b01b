"""Operator tools: the ``celery redsem`` command and the admin functions behind it."""
