"""The grant handed from a worker's main process to its pool child, on Celery's own Context."""

from __future__ import annotations

from celery.app.task import Context

from celery_redsem import Permit
from celery_redsem.handoff import GRANT_FIELD, clear_grant, hand_over, take_over

PERMIT = Permit("task-1", "report:7", 42, 1_800_000_000_000, 5.0, "redsem")


def _request(request_dict: dict[str, object]) -> Context:
    return Context({"id": "task-1", **request_dict})


def test_a_handed_grant_is_taken_over_once() -> None:
    request_dict: dict[str, object] = {}
    hand_over(request_dict, PERMIT, 123.5)
    request = _request(request_dict)
    assert GRANT_FIELD in request.headers  # Celery's Context copies unknown fields there
    assert take_over(request, "report:7", "redsem", 5.0) == (PERMIT, 123.5)
    assert take_over(request, "report:7", "redsem", 5.0) is None  # removed when taken
    assert not hasattr(request, GRANT_FIELD)
    assert GRANT_FIELD not in request.headers  # so self.retry() cannot publish the secret


def test_a_grant_for_another_task_semaphore_or_prefix_is_refused() -> None:
    request_dict: dict[str, object] = {}
    hand_over(request_dict, PERMIT, 1.0)
    assert take_over(_request(request_dict), "report:8", "redsem", 5.0) is None
    assert take_over(_request(request_dict), "report:7", "other", 5.0) is None
    assert take_over(Context({**request_dict, "id": "task-2"}), "report:7", "redsem", 5.0) is None


def test_a_forged_or_malformed_grant_is_refused() -> None:
    request_dict: dict[str, object] = {}
    hand_over(request_dict, PERMIT, 1.0)
    genuine = list(request_dict[GRANT_FIELD])  # type: ignore[call-overload]
    forged = ["0" * 32, *genuine[1:]]  # a header from outside cannot know the secret
    assert take_over(_request({GRANT_FIELD: forged}), "report:7", "redsem", 5.0) is None
    for bad in (None, "x", genuine[:-1], [*genuine[:4], "42", *genuine[5:]], [*genuine[:6], 1]):
        assert take_over(_request({GRANT_FIELD: bad}), "report:7", "redsem", 5.0) is None


def test_clear_grant_removes_a_stale_one() -> None:
    request_dict: dict[str, object] = {}
    hand_over(request_dict, PERMIT, 1.0)
    clear_grant(request_dict)
    assert GRANT_FIELD not in request_dict
    clear_grant(request_dict)  # nothing there: fine
