"""The worker-start warning about guarded ``acks_late`` tasks and broker connection loss."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_redsem import with_lock
from celery_redsem.integration.guards.base import iter_guarded_tasks
from celery_redsem.integration.worker.start_checks import check_late_acks


def _app(acks_late: bool, **conf: object) -> Celery:
    app = Celery(set_as_current=False, broker="memory://")
    app.conf.update(conf)

    @app.task(shared=False, name="reports.build", acks_late=acks_late)
    @with_lock(key=lambda report_id: f"report:{report_id}")
    def build(report_id: int) -> None: ...

    @app.task(shared=False, name="plain", acks_late=True)  # not guarded: none of our business
    def plain() -> None: ...

    app.finalize()
    return app


@pytest.mark.parametrize(
    ("acks_late", "conf", "warns"),
    [
        (True, {}, True),
        (True, {"worker_cancel_long_running_tasks_on_connection_loss": True}, False),
        (False, {}, False),
    ],
)
def test_guarded_late_acks_without_cancel_on_connection_loss_are_warned_about(
    acks_late: bool, conf: dict[str, object], warns: bool
) -> None:
    app = _app(acks_late, **conf)
    warning = check_late_acks(app, [task for task, _ in iter_guarded_tasks(app)])
    if warns:
        assert warning is not None
        assert "reports.build" in warning
        assert "plain" not in warning
        assert "worker_cancel_long_running_tasks_on_connection_loss = True" in warning
    else:
        assert warning is None
