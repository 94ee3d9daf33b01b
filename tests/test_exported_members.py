"""The package's public names are exactly its ``__all__``."""

from __future__ import annotations
import __future__

import types

import celery_redsem


def test_all_names_the_public_members_and_nothing_else():
    names = dir(celery_redsem)  # the Celery names load on first access: dir() lists them too
    public = {
        name
        for name, value in ((n, getattr(celery_redsem, n)) for n in names)
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType | __future__._Feature)
    }
    assert public | {"__version__"} == set(celery_redsem.__all__)
    for name in celery_redsem.__all__:
        assert getattr(celery_redsem, name) is not None


def test_every_exception_derives_from_the_base():
    errors = [
        value
        for value in vars(celery_redsem).values()
        if isinstance(value, type) and issubclass(value, Exception)
    ]
    assert len(errors) >= 7
    assert all(issubclass(e, celery_redsem.RedsemError) for e in errors)
