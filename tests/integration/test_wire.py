"""The grant handed from a worker's main process to its pool child, on Celery's own Context."""

from __future__ import annotations

from celery import Celery
from celery.app.task import Context
from celery.contrib.testing.mocks import TaskMessage
from celery.worker.request import Request

from celery_redsem import Permit
from celery_redsem.core.permit_ids import permit_id_of, run_permit_id
from celery_redsem.integration.wire import GRANT_FIELD, clear_dispatch_fields, hand_over, take_grant
from tests.integration.conftest import close_app

PERMIT = Permit("task-1", "report:7", 42, 1_800_000_000_000, 5.0, "redsem")


def _request(request_dict: dict[str, object]) -> Context:
    return Context({"id": "task-1", **request_dict})


def test_a_handed_grant_is_taken_over_once() -> None:
    request_dict: dict[str, object] = {}
    hand_over(request_dict, PERMIT, 123.5)
    request = _request(request_dict)
    assert GRANT_FIELD in request.headers  # Celery's Context copies unknown fields there
    assert take_grant(request, "report:7", "redsem", 5.0) == (PERMIT, 123.5)
    assert take_grant(request, "report:7", "redsem", 5.0) is None  # removed when taken
    assert not hasattr(request, GRANT_FIELD)
    assert GRANT_FIELD not in request.headers  # so self.retry() cannot publish the secret


def test_a_grant_for_another_task_semaphore_or_prefix_is_refused() -> None:
    request_dict: dict[str, object] = {}
    hand_over(request_dict, PERMIT, 1.0)
    assert take_grant(_request(request_dict), "report:8", "redsem", 5.0) is None
    assert take_grant(_request(request_dict), "report:7", "other", 5.0) is None
    assert take_grant(Context({**request_dict, "id": "task-2"}), "report:7", "redsem", 5.0) is None


def test_a_forged_or_malformed_grant_is_refused() -> None:
    request_dict: dict[str, object] = {}
    hand_over(request_dict, PERMIT, 1.0)
    genuine = list(request_dict[GRANT_FIELD])  # type: ignore[call-overload]
    forged = ["0" * 32, *genuine[1:]]  # a header from outside cannot know the secret
    assert take_grant(_request({GRANT_FIELD: forged}), "report:7", "redsem", 5.0) is None
    for bad in (None, "x", genuine[:-1], [*genuine[:4], "42", *genuine[5:]], [*genuine[:6], 1]):
        assert take_grant(_request({GRANT_FIELD: bad}), "report:7", "redsem", 5.0) is None


def test_clear_dispatch_fields_removes_a_stale_one() -> None:
    request_dict: dict[str, object] = {}
    hand_over(request_dict, PERMIT, 1.0)
    clear_dispatch_fields(request_dict)
    assert GRANT_FIELD not in request_dict
    clear_dispatch_fields(request_dict)  # nothing there: fine


def test_a_run_queued_by_the_task_itself_has_a_permit_id_of_its_own() -> None:
    assert run_permit_id("t") == "t"
    assert run_permit_id("t", 2) == "t~2"
    assert run_permit_id("t", 0, 1) == "t~0.1"
    assert run_permit_id("t", 3, 2) == "t~3.2"
    for junk in (None, -1, True, "2", 1.5):  # a message's numbers are not trusted
        assert run_permit_id("t", junk, junk) == "t"
    # A custom task id with a "~" cannot pose as another task's retried run.
    assert run_permit_id("order-42~1") == "order-42~1~0"
    assert run_permit_id("order-42", 1) == "order-42~1"
    assert run_permit_id("order-42~1", 1) == "order-42~1~1"
    # Ids past the limit (256) are hashed, so a retry of a long custom id still fits.
    long_id = "x" * 256
    assert run_permit_id(long_id) == long_id
    first_retry = run_permit_id(long_id, 1)
    assert first_retry.startswith("#")
    assert first_retry.endswith("~1")
    assert len(first_retry) <= 256
    assert run_permit_id(long_id, 2) != first_retry
    assert run_permit_id("y" * 256, 1) != first_retry
    # In the child (Context) and in the main process (a worker Request's request_dict) alike.
    assert permit_id_of(Context({"id": "t", "retries": 1})) == "t~1"

    app = Celery("handoff", set_as_current=False)

    @app.task(name="t.x")
    def x() -> None:
        """A task for the message to name."""

    message = TaskMessage("t.x", id="t", retries=1, replaced_task_nesting=1)  # a real message
    assert permit_id_of(Request(message, app=app)) == "t~1.1"
    close_app(app)


def test_a_grant_is_taken_over_only_by_the_run_it_was_made_for() -> None:
    retried = Permit("task-1~1", "report:7", 42, 1_800_000_000_000, 5.0, "redsem")
    request_dict: dict[str, object] = {"retries": 1}
    hand_over(request_dict, retried, 1.0)
    assert take_grant(_request(request_dict), "report:7", "redsem", 5.0) == (retried, 1.0)
    hand_over(request_dict, PERMIT, 1.0)  # the first run's grant, on the retried run
    assert take_grant(_request(request_dict), "report:7", "redsem", 5.0) is None


def test_task_ids_the_semaphore_cannot_take_as_they_are_map_to_distinct_ids() -> None:
    long_id = "L" * 300
    hashed = run_permit_id(long_id)
    assert hashed.startswith("#")
    assert len(hashed) <= 256
    # A task id that is itself '#' and a hash cannot pass for the long one (issue 39, item 10),
    # and one starting with ':' (the semaphore's own fields do) is mapped too (item 3).
    assert run_permit_id(hashed) not in (hashed, long_id)
    assert run_permit_id(hashed).startswith("#")
    colon = run_permit_id(":order-1")
    assert colon.startswith("#")
    assert run_permit_id(":order-1", 2) == colon + "~2"
    assert len({run_permit_id(i) for i in (":a", "#a", "a", ":b", "#" + "0" * 64)}) == 5
