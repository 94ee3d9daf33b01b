"""The checks a worker with guarded tasks runs as it starts.

:func:`refuse_without_redis` stops a worker (at ``worker_init``) that has guarded tasks but no
usable Redis setting: every guarded task would fail. (A server that is set but unreachable is
no reason: tasks retry until it answers.) The :class:`StartChecks` bootstep logs, once the
worker's logging is set up, what :func:`start_warnings` finds: ``acks_late`` tasks that a lost
broker connection would run twice, leases too short for the socket timeout, a ``maxmemory-policy``
that could evict semaphore keys, and admission turned off because Celery's internals are not
as it expects (:func:`~celery_redsem.integration.seam.probe`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task, bootsteps

from celery_redsem.core.client import RedisClient
from celery_redsem.core.errors import (
    REDIS_ERRORS,
    BackendError,
    ConfigurationError,
    RedsemError,
    is_transient,
)
from celery_redsem.integration.guards.base import Guard, iter_guarded_tasks
from celery_redsem.integration.policy import MAX_PARKED
from celery_redsem.integration.settings import (
    RedsemConfig,
    deferred_setting_warnings,
    get_client,
    get_config,
    refresh_stall_warning,
)
from celery_redsem.integration.worker.request import has_child_processes

__all__ = [
    "KOMBU_REDIS_CONNECTIONS",
    "GreenEventsCheck",
    "StartChecks",
    "check_broker_pool",
    "check_eviction_policy",
    "check_late_acks",
    "check_task_leases",
    "check_visibility_timeout",
    "refuse_without_redis",
    "start_warnings",
]

logger = logging.getLogger(__name__)

_EVICTING = ("allkeys-", "volatile-")


def check_eviction_policy(client: RedisClient) -> str | None:
    """A warning if the server's ``maxmemory-policy`` could evict semaphore keys, or if it
    cannot be asked (not reachable, or refusing); None if all is well.

    Semaphore keys carry TTLs, so ``volatile-*`` policies can evict them as well as
    ``allkeys-*``. Read from ``INFO memory`` (which the documented ACL rule allows, unlike
    ``CONFIG GET``); on a cluster every node is checked.
    """
    try:
        reply = client.info("memory")
    except REDIS_ERRORS as exc:
        if is_transient(exc):
            return (
                f"celery_redsem: cannot reach the semaphores' Redis at worker start ({exc}); "
                "guarded tasks are retried until it answers (for up to redsem_max_wait)"
            )
        return (
            f"celery_redsem: the semaphores' Redis refused INFO at worker start ({exc}): "
            "its maxmemory-policy was not checked; if it refuses the scripts too, guarded "
            "tasks fail saying why"
        )
    per_node = reply.values() if "maxmemory_policy" not in reply else [reply]
    policies = {str(node.get("maxmemory_policy")) for node in per_node if isinstance(node, dict)}
    evicting = sorted(p for p in policies if p.startswith(_EVICTING))
    if evicting:
        return (
            f"celery_redsem: Redis maxmemory-policy is {evicting[0]!r}: under memory pressure the "
            "server may evict semaphore keys and let more tasks run than the limit allows; use "
            "'noeviction' (or a separate Redis for semaphores)"
        )
    return None


def check_late_acks(app: Celery, tasks: list[Task[Any, Any]]) -> str | None:
    """A warning if guarded tasks acknowledge late while a lost broker connection leaves them
    running (``worker_cancel_long_running_tasks_on_connection_loss`` off, Celery 5's default):
    the broker then delivers a running task again, maybe to another worker, and both copies
    run on the task id's one permit. None if nothing to say."""
    if app.conf.get("worker_cancel_long_running_tasks_on_connection_loss"):
        return None
    late = sorted(task.name for task in tasks if getattr(task, "acks_late", False))
    if not late:
        return None
    return (
        f"celery_redsem: guarded tasks with acks_late ({', '.join(late[:5])}"
        f"{', ...' if len(late) > 5 else ''}) keep running when the broker connection is "
        "lost, and the broker delivers them again: on another worker the two copies would "
        "share the task id's permit. Set worker_cancel_long_running_tasks_on_connection_loss"
        " = True (in Django settings: CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS)"
    )


def check_task_leases(
    config: RedsemConfig, guarded: list[tuple[Task[Any, Any], list[Guard]]]
) -> list[str]:
    """A warning for each task (of ``guarded``: tasks with their guards) whose own ``lease=``
    is so short that one hung Redis call can outlast a heartbeat interval (``redsem_lease``
    is checked when the settings are read)."""
    warnings = []
    for task, guards in guarded:
        for guard in guards:
            if guard.lease is not None:
                warning = refresh_stall_warning(config, guard.lease, f"{task.name}'s lease")
                if warning:
                    warnings.append(warning)
    return warnings


class StartChecks(bootsteps.StartStopStep):
    """Logs celery_redsem's start-up warnings as the worker starts, once its logging is set up
    (``worker_init`` comes before that: a warning logged there has no time and no level)."""

    label = "celery_redsem checks"

    def start(self, parent: Any) -> None:
        found = getattr(parent, "redsem_start_warnings", [])  # (admission's, say)
        concurrency = int(getattr(parent, "concurrency", 0) or 0)
        pool = check_broker_pool(parent.app, parent.pool_cls, concurrency)
        visibility = check_visibility_timeout(parent.app)
        for warning in [*found, *start_warnings(parent.app), pool, visibility]:
            if warning:
                logger.warning(warning)


class GreenEventsCheck(bootsteps.StartStopStep):
    """A consumer step that warns, once its event dispatcher is made, about Celery's own pace
    on a gevent or eventlet worker with RabbitMQ (:func:`check_green_event_drain`)."""

    label = "celery_redsem green events check"
    requires = ("celery.worker.consumer.events:Events",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._warned = False

    def start(self, parent: Any) -> None:
        warning = None if self._warned else check_green_event_drain(parent)
        if warning:
            self._warned = True
            logger.warning(warning)


def check_green_event_drain(consumer: Any) -> str | None:
    """A warning if the worker's consumer (without an event loop: gevent, eventlet) drains its
    event connection after every message it reads: Celery's loop there waits up to 0.1 s on
    that connection each time (when it sends events and RabbitMQ heartbeats are on), so the
    worker takes at most about 10 messages a second, guarded or not."""
    dispatcher = getattr(consumer, "event_dispatcher", None)
    connection = getattr(dispatcher, "connection", None)
    green = getattr(getattr(consumer, "pool", None), "is_green", False)
    if not (green and getattr(dispatcher, "enabled", False) and consumer.amqheartbeat):
        return None
    if not getattr(connection, "supports_heartbeats", False):
        return None
    return (
        "celery_redsem: this gevent/eventlet worker reads at most about 10 messages a second "
        "from RabbitMQ, guarded tasks or not: after each message, Celery's loop waits 0.1 s on "
        "its event connection when it sends events and broker heartbeats are on. Set "
        "broker_heartbeat = 0 (Django: CELERY_BROKER_HEARTBEAT), or start the worker with "
        "--without-heartbeat --without-gossip and without -E"
    )


#: kombu's Redis transport: connections per channel pool unless max_connections says.
KOMBU_REDIS_CONNECTIONS = 10


def check_broker_pool(app: Celery, pool_cls: Any, concurrency: int) -> str | None:
    """A warning if the worker runs more tasks at once in one process (threads, gevent,
    eventlet) than the Redis broker's connection pool holds (kombu's ``max_connections``, 10
    by default): acks and deliveries from that many at once run out of connections ("Couldn't
    ack ... MaxConnectionsError"), and the broker delivers those tasks again."""
    if has_child_processes(pool_cls) or not _redis_broker(app):
        return None
    options = app.conf.broker_transport_options or {}
    limit = options.get("max_connections", KOMBU_REDIS_CONNECTIONS)
    if not isinstance(limit, int) or concurrency <= limit:
        return None
    return (
        f"celery_redsem: this worker runs up to {concurrency} tasks at once in one process, and "
        f"the Redis broker's connection pool holds {limit} (kombu's max_connections): acks sent "
        "together run out of connections, and the broker then delivers those tasks again. Set "
        f"broker_transport_options = {{'max_connections': {concurrency + 10}}} (in Django "
        "settings: CELERY_BROKER_TRANSPORT_OPTIONS)"
    )


def check_visibility_timeout(app: Celery) -> str | None:
    """A warning if the Redis broker's ``visibility_timeout`` is too short for parking: a task
    waits parked (unacknowledged) for at most half of it, then goes back through the broker
    (a retry), so a long line would cycle through the broker instead of waiting in the
    worker; and a worker holds an ETA task (a retry's countdown) unacknowledged too."""
    if not _redis_broker(app):
        return None
    options = app.conf.broker_transport_options or {}
    visibility = options.get("visibility_timeout")
    if not isinstance(visibility, int | float) or isinstance(visibility, bool):
        return None
    if visibility >= 2 * MAX_PARKED:
        return None
    return (
        f"celery_redsem: the Redis broker's visibility_timeout is {visibility:g}s: a guarded task "
        f"waits parked in the worker for at most half of it ({visibility / 2:g}s), then goes "
        "back through the broker, so a long line cycles through retries; set "
        f"broker_transport_options = {{'visibility_timeout': {int(2 * MAX_PARKED)}}} or more "
        "(Celery's default is 3600)"
    )


def _redis_broker(app: Celery) -> bool:
    url = app.conf.broker_url or ""
    first = (url[0] if isinstance(url, list | tuple) and url else url) or ""
    return str(first).split("://", 1)[0].lower() in ("redis", "rediss", "sentinel")


def start_warnings(app: Celery) -> list[str]:
    """What a worker of ``app`` should warn about at start: late acks, leases too short for
    the socket timeout, an eviction policy that could drop semaphore keys."""
    with_guards = list(iter_guarded_tasks(app))
    if not with_guards:
        return []
    config = get_config(app)
    warnings = [
        *deferred_setting_warnings(app),
        check_late_acks(app, [task for task, _guards in with_guards]),
        refresh_stall_warning(config, config.lease, "redsem_lease"),
        *check_task_leases(config, with_guards),
    ]
    if config.check_eviction_policy:
        try:
            warnings.append(check_eviction_policy(get_client(app)))
        except RedsemError as exc:  # a cluster client asks the cluster as it is built
            warnings.append(f"celery_redsem: cannot check Redis at worker start: {exc}")
    return [warning for warning in warnings if warning]


def refuse_without_redis(app: Celery, guarded: list[Task[Any, Any]]) -> None:
    """Stop a worker that has guarded tasks but no usable Redis setting, with one message
    (every guarded task would fail). An unreachable server is no reason: tasks retry."""
    try:
        get_config(app).require_redis_url()
        get_client(app)
    except ConfigurationError as exc:
        names = ", ".join(sorted(task.name for task in guarded)[:5])
        raise SystemExit(
            f"celery_redsem: this worker cannot run its guarded tasks ({names}"
            f"{', ...' if len(guarded) > 5 else ''}): {exc}"
        ) from None
    except BackendError:
        pass  # a cluster that cannot be reached now: StartChecks warns, tasks retry
