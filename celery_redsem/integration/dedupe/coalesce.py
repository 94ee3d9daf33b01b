"""Newest wins (``dedupe="coalesce"``, ``debounce=``): one run running and one pending per key.

Per key, :class:`~celery_redsem.core.marks.CoalesceRecord` holds the running run and at most one
pending run with the newest arguments. A send (:func:`send`) while a run is pending queues
nothing: it writes its arguments to the record and returns the pending run's ``AsyncResult``.
A message that did not go through the send (``send_task``, a canvas step) is decided on receipt
in the worker's main process (:func:`receive`): it becomes the pending run, or the pending run
absorbs it (it then ends as it starts, storing no result; the run that carries its arguments
stores its result under its id too). A canvas step is never absorbed, since its canvas goes on
from its own message: it takes the place of a plain pending run, or waits its turn behind
another canvas step.

The pending run, holding its permit, takes the newest arguments and becomes the running run
(:mod:`~celery_redsem.integration.dedupe.coalesce_run`), unless it is not yet due (``debounce``:
it is published with a countdown and, found early, re-published for the rest, without touching
``max_retries``). When it ends (``task_postrun``, in its child) its result or error is stored
under every id it answers for; a run whose child was lost, or that was revoked or expired,
fails them (:func:`abandon`, from the worker's main process). Arguments are serialized with the
task's serializer and loaded only as the app accepts content; above :data:`MAX_ARGUMENT_BYTES`
a send raises :class:`~celery_redsem.ConfigurationError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import Celery, Task, states
from celery.exceptions import WorkerLostError
from celery.utils import uuid
from kombu.serialization import dumps, loads, prepare_accept_content

from celery_redsem.core.errors import BackendError, ConfigurationError
from celery_redsem.core.marks import Arguments, CoalesceRecord, Debounce
from celery_redsem.core.validation import SECONDS
from celery_redsem.integration.seam import message_embed
from celery_redsem.integration.settings import RedsemConfig, get_client, get_config
from celery_redsem.integration.wire import mark_duplicate
from celery_redsem.metrics import record_coalesced
from celery_redsem.signals import task_coalesced

__all__ = [
    "CANVAS_FIELDS",
    "CANVAS_OPTIONS",
    "MAX_ARGUMENT_BYTES",
    "abandon",
    "announce",
    "check_debounce",
    "deserialize",
    "receive",
    "record_of",
    "send",
    "serialize",
    "store_results",
]

logger = logging.getLogger(__name__)

#: Largest serialized arguments (bytes) a coalesced send keeps in Redis.
MAX_ARGUMENT_BYTES = 64 * 1024
#: Options of a send that make it a step of a canvas.
CANVAS_OPTIONS = ("chain", "link", "link_error", "group_id", "chord", "parent_id", "root_id")
#: Fields of a request that make its run a step of a canvas.
CANVAS_FIELDS = ("callbacks", "errbacks", "chain", "chord", "group")

Original = Callable[..., Any]


def record_of(app: Celery, name: str, config: RedsemConfig | None = None) -> CoalesceRecord:
    """The coalesce record of semaphore ``name`` in ``app``'s Redis."""
    config = config or get_config(app)
    return CoalesceRecord(get_client(app), name, prefix=config.key_prefix)


def serialize(task: Task[Any, Any], args: Any, kwargs: Any, name: str) -> Arguments:
    """A call's arguments serialized as the task's messages are; ConfigurationError if they
    are larger than :data:`MAX_ARGUMENT_BYTES`."""
    content_type, encoding, data = dumps(
        [list(args or ()), dict(kwargs or {})], serializer=task.serializer
    )
    raw = data if isinstance(data, bytes) else str(data).encode()
    if len(raw) > MAX_ARGUMENT_BYTES:
        raise ConfigurationError(
            f"the arguments of {task.name} for {name!r} are {len(raw)} bytes serialized; "
            f"dedupe='coalesce' keeps at most {MAX_ARGUMENT_BYTES} bytes of them in Redis: "
            "pass a reference (an id) instead of the data"
        )
    return Arguments(raw, content_type, encoding)


def deserialize(app: Celery, arguments: Arguments) -> tuple[list[Any], dict[str, Any]]:
    """Arguments as written by :func:`serialize`, loaded only as ``app`` accepts content."""
    args, kwargs = loads(
        arguments.data,
        arguments.content_type,
        arguments.content_encoding,
        accept=prepare_accept_content(app.conf.accept_content),
    )
    return list(args), dict(kwargs)


def send(
    task: Task[Any, Any],
    name: str,
    call: tuple[Any, Any, str | None, dict[str, Any]],
    original: Original,
    *,
    debounce: Debounce,
    ttl: float,
) -> Any:
    """A coalesced send of ``task`` on ``name`` (``call``: args, kwargs, task id, options):
    absorbed by the pending run (its ``AsyncResult``), or published as the pending run (with
    ``debounce``, on a countdown), which counts as live for ``ttl`` seconds (then a send
    starts another)."""
    args, kwargs, given_id, options = call
    task_id = given_id or uuid()
    if any(options.get(o) for o in CANVAS_OPTIONS) or task.app.conf.task_always_eager:
        return original(task, args, kwargs, task_id=task_id, **options)  # decided on receipt
    config = get_config(task.app)
    arguments = serialize(task, args, kwargs, name)
    record = record_of(task.app, name, config)
    try:
        decided = record.send(task_id, arguments, ttl, debounce, own_id=bool(given_id))
    except BackendError as exc:
        logger.warning(
            "celery_redsem: could not coalesce %s[%s] on %r, sent as it is (the worker "
            "decides as it receives it): %s",
            task.name,
            task_id,
            name,
            exc,
        )
        return original(task, args, kwargs, task_id=task_id, **options)
    if decided.status == "absorbed":
        announce(task, name, decided.task_id, given_id, debounced=bool(debounce.wait))
        return task.AsyncResult(decided.task_id)
    if decided.delay and options.get("countdown") is None and options.get("eta") is None:
        options = {**options, "countdown": decided.delay}
    try:
        return original(task, args, kwargs, task_id=task_id, **options)
    except BaseException:
        _finish_quietly(record, task_id)  # never sent: the key has no pending run
        raise


def receive(task: Task[Any, Any], name: str, debounce: Debounce, request: Any, ttl: float) -> None:
    """In the worker's main process, for a message just received: it becomes the pending run
    (live ``ttl`` seconds), takes a plain pending run's place (a canvas step), or is absorbed
    (the run then ends as it starts: :data:`~celery_redsem.integration.wire.DUPLICATE_FIELD`)."""
    request_dict = request.request_dict
    config = get_config(task.app)
    try:
        arguments = serialize(task, request.args, request.kwargs, name)
    except ConfigurationError:
        return  # the run fails as it starts, saying so
    fields = {**request_dict, **message_embed(request)}
    canvas = any(fields.get(f) for f in CANVAS_FIELDS)
    record = record_of(task.app, name, config)
    decided = record.receive(request.id, arguments, ttl, debounce, canvas=canvas)
    debounced = bool(debounce.wait)
    if decided.status == "absorbed":
        mark_duplicate(request_dict, decided.task_id)
        announce(task, name, decided.task_id, request.id, debounced=debounced)
    elif decided.status == "took":
        announce(task, name, request.id, decided.task_id, debounced=debounced)


def announce(
    task: Task[Any, Any], name: str, into: str, absorbed: str | None, *, debounced: bool
) -> None:
    """A send or message was absorbed by the pending run ``into``: signal and metrics."""
    record_coalesced(task.name, "debounced" if debounced else "coalesced")
    task_coalesced.send(
        sender=task, task_id=into, absorbed_id=absorbed, name=name, debounced=debounced
    )


def store_results(task: Task[Any, Any], ids: list[str], retval: Any, state: str) -> None:
    """Store ``retval`` (an error if ``state`` is FAILURE) under each of ``ids``."""
    for other in ids:
        try:
            if state == states.FAILURE:
                task.backend.mark_as_failure(other, retval)
            else:
                task.backend.mark_as_done(other, retval)
        except Exception as exc:  # (a backend failure is logged, not raised)
            logger.warning(
                "celery_redsem: could not store the result of %s for %s: %s", task.name, other, exc
            )


def abandon(task: Task[Any, Any], name: str, task_id: str) -> None:
    """From the worker's main process: the run ``task_id`` ended without a result (lost
    child, revoked, expired): fail the sends it answered for, saying so."""
    record = record_of(task.app, name)
    try:
        answered = record.finish(task_id)
    except BackendError as exc:
        logger.warning("celery_redsem: could not finish the coalesce record of %r: %s", name, exc)
        return
    error = WorkerLostError(
        f"run {task_id} of {task.name} on {name!r}, which carried this send's arguments, "
        "ended without a result (its worker was lost, or it was revoked or expired)"
    )
    pending = [i for i in answered if task.backend.get_state(i) not in states.READY_STATES]
    store_results(task, pending, error, states.FAILURE)


def _finish_quietly(record: CoalesceRecord, task_id: str) -> None:
    try:
        record.finish(task_id)
    except BackendError as exc:
        logger.warning("celery_redsem: could not clear %r of %s: %s", record, task_id, exc)


def check_debounce(dedupe: object, debounce: object, debounce_max: object, where: str) -> Debounce:
    """``debounce=`` and ``debounce_max=`` of a guard, checked (ConfigurationError)."""
    if debounce is None:
        if debounce_max is not None:
            raise ConfigurationError(f"debounce_max of {where} needs debounce= too")
        return Debounce()
    if dedupe != "coalesce":
        raise ConfigurationError(
            f"debounce of {where} needs dedupe='coalesce' (it has dedupe={dedupe!r})"
        )
    wait = SECONDS.check(debounce, f"debounce of {where}")
    most = 0.0 if debounce_max is None else SECONDS.check(debounce_max, f"debounce_max of {where}")
    if debounce_max is not None and most < wait:
        raise ConfigurationError(
            f"debounce_max of {where} ({most}s) must be at least its debounce ({wait}s)"
        )
    return Debounce(wait, most)
