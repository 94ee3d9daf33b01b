"""``celery redsem``: look at and administer semaphores from the command line.

Installed through the ``celery.commands`` entry point, so it runs with your app's settings::

    celery -A proj redsem status --pattern 'market:*'
    celery -A proj redsem inspect market:42      # its rate limiter too, if it has one
    celery -A proj redsem release market:42 <task id>
    celery -A proj redsem purge --yes

Every command takes ``--json`` for scripts. The Redis URL and key prefix come from the app's
``redsem_*`` settings unless ``--url`` / ``--prefix`` are given. A NAME is always a name
(``t:[ab]`` is the semaphore of that name); a glob is given with ``--pattern``. Names and ids
are printed escaped when they hold control characters, and a semaphore that cannot be read is
skipped with a warning on standard error instead of failing the listing.
"""

from __future__ import annotations

import getpass
import json
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NoReturn, TypeVar

import click

from celery_redsem.core.client import RedisClient
from celery_redsem.core.clients import client_from_url
from celery_redsem.core.errors import REDIS_ERRORS, BackendError, RedsemError
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.permits import SemaphoreState
from celery_redsem.core.rate_limit import RateState, pause_rate_limiter, read_rate_state
from celery_redsem.core.redaction import redact_url, scrub
from celery_redsem.core.state import read_state
from celery_redsem.core.validation import MAX_SECONDS, validate_prefix
from celery_redsem.ops.admin import (
    OnSkip,
    coalesce_state,
    force_release,
    glob_escape,
    group_lines,
    groups_of,
    purge,
    rate_states,
    state_to_dict,
    states,
)

__all__ = ["redsem"]

DEFAULT_MAX = 200
#: Waiters of each semaphore `status` lists (in text) unless told otherwise.
DEFAULT_WAITERS = 20


@dataclass
class _Target:
    """Where the commands look: a client, the key prefix and the idle TTL (from the app)."""

    client: RedisClient
    prefix: str
    idle_ttl: float
    url: str


def _fail(message: str) -> NoReturn:
    raise click.ClickException(message)


def _target(ctx: click.Context) -> _Target:
    """Connect lazily (``--help`` never touches Redis), once per invocation."""
    root = ctx.find_root()
    cached = root.meta.get("redsem.target")
    if isinstance(cached, _Target):
        return cached
    options: dict[str, Any] = root.meta.get("redsem.options", {})
    app = getattr(ctx.obj, "app", None)
    if app is None:
        _fail("no Celery app: run this as `celery -A proj redsem ...`")
    from celery_redsem.integration.settings import get_client, get_config

    try:
        config = get_config(app)
        prefix = validate_prefix(options.get("prefix") or config.key_prefix)
        if options.get("url"):
            url = options["url"]
            client = client_from_url(url, **config.redis_options)
        else:
            url = config.require_redis_url()
            client = get_client(app)
    except RedsemError as exc:
        _fail(scrub(str(exc), options.get("url")))
    target = _Target(client, prefix, config.idle_ttl, redact_url(url))
    root.meta["redsem.target"] = target
    return target


def _style(ctx: click.Context, text: str, **kwargs: Any) -> str:
    obj = ctx.obj
    if obj is not None and getattr(obj, "no_color", False):
        return text
    return click.style(text, **kwargs)


def _shown(text: str) -> str:
    """``text`` as it is if printable, else quoted with escapes: a stored id or name with a
    newline or a terminal escape cannot fake or hide lines of the output."""
    return text if text.isprintable() else ascii(text)


def _seconds(ms: int) -> str:
    return f"{max(ms, 0) / 1000:.1f}s"


def _print_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def _summary_line(ctx: click.Context, state: SemaphoreState, paused: float = 0.0) -> str:
    limit = "?" if state.limit is None else str(state.limit)
    held = f"{len(state.holders)}/{limit}"
    full = state.limit is not None and len(state.holders) >= state.limit
    return (
        f"{_style(ctx, _shown(state.name), bold=True)}  limit {limit}  "
        f"held {_style(ctx, held, fg='yellow' if full else 'green')}  "
        f"waiting {len(state.waiters)}  last token {state.last_token or '-'}"
    ) + (_style(ctx, f"  PAUSED {paused:.1f}s", fg="red") if paused else "")


def _rate_line(ctx: click.Context, state: RateState) -> str:
    rate = "?" if state.rate is None else f"{state.rate:g}/s"
    more = "".join(f"  + {w.rate:g}/s burst {w.burst}" for w in state.windows[1:])
    left = "/".join(str(w.remaining) for w in state.windows) or "?"
    paused = _style(ctx, f"  PAUSED {state.paused:.1f}s", fg="red") if state.paused else ""
    return (
        f"{_style(ctx, _shown(state.name), bold=True)}  rate limiter {rate}  "
        f"burst {state.burst or '?'}{more}  next free in {state.next_free:.3f}s  "
        f"booked {state.booked}  units left {left}{paused}"
    )


def _holder_lines(state: SemaphoreState) -> list[str]:
    return [
        f"  holder  {_shown(h.permit_id)}  token {h.token}  lease {_seconds(h.remaining_ms)} left"
        for h in state.holders
    ]


def _waiter_lines(state: SemaphoreState, most: int | None = None) -> list[str]:
    """A line per waiter, first in line first; past ``most`` (None: no cap), one line that
    says how many more."""
    shown = state.waiters if most is None else state.waiters[:most]
    lines = [
        f"  waiter  #{n}  {_shown(w.permit_id)}  ticket {w.ticket}  "
        f"place kept {_seconds(w.remaining_ms)}"
        for n, w in enumerate(shown, start=1)
    ]
    if len(state.waiters) > len(shown):
        lines.append(f"  ... and {len(state.waiters) - len(shown)} more waiting (--waiters)")
    return lines


def _runs_line(runs: dict[str, Any]) -> str:
    """The running and pending runs of a key (``dedupe="coalesce"``), on one line."""
    running = runs["running"] and _shown(runs["running"])
    if running and not runs["running_live"]:
        running += " (its lease ended)"
    pending = runs["pending"] and _shown(runs["pending"])
    if pending:
        pending += f" (due in {runs['due_in']:.1f}s, answers for {runs['answers']} more)"
    return f"  runs: running {running or '-'}; pending {pending or '-'}"


def _ttls(client: RedisClient, keys: list[str]) -> dict[str, int]:
    """Milliseconds left of each existing key (keys without a TTL show -1)."""
    try:
        found = {key: int(client.pttl(key)) for key in keys}
    except REDIS_ERRORS as exc:
        raise BackendError(f"Redis failed reading key TTLs: {exc}") from exc
    return {key: ttl for key, ttl in found.items() if ttl != -2}


def _run(action: Any) -> Any:
    try:
        return action()
    except RedsemError as exc:
        _fail(str(exc))


@click.group(name="redsem")
@click.option("--url", help="Redis URL (default: the app's redsem_redis_url setting).")
@click.option("--prefix", help="Key prefix (default: the app's redsem_key_prefix setting).")
@click.pass_context
def redsem(ctx: click.Context, url: str | None, prefix: str | None) -> None:
    """Inspect and administer celery_redsem semaphores and locks."""
    ctx.find_root().meta["redsem.options"] = {"url": url, "prefix": prefix}


def _selection(name: str | None, pattern: str | None) -> str:
    """The SCAN glob for NAME (matched exactly) or ``--pattern``; every semaphore if neither."""
    if name is not None and pattern is not None:
        raise click.UsageError("give a NAME or --pattern, not both")
    if name is not None:
        return glob_escape(name)
    return "*" if pattern is None else pattern


def _none_found(target: _Target, name: str | None, pattern: str) -> str:
    if name is None:
        return f"No semaphore under prefix {target.prefix!r} matches {pattern!r}."
    hint = ""
    if glob_escape(name) != name:
        hint = f" (NAME is a name, not a glob; to match a pattern use --pattern {name!r})"
    return f"No semaphore {name!r} under prefix {target.prefix!r}{hint}."


def _skipped_list(found: list[dict[str, str]]) -> OnSkip:
    """An ``on_skip`` for :func:`states` that warns on standard error and records the skip."""

    def on_skip(name: str, exc: Exception) -> None:
        found.append({"name": name, "error": str(exc)})
        click.echo(f"Warning: skipped semaphore {_shown(name)}: {exc}", err=True)

    return on_skip


_pattern_option = click.option(
    "--pattern",
    "-p",
    metavar="GLOB",
    help="Select the semaphores whose name matches GLOB (Redis glob syntax) instead of one NAME.",
)


_F = TypeVar("_F", bound=Callable[..., Any])


def _at_most_option(
    flag: str, dest: str, minimum: int, default: int, what: str
) -> Callable[[_F], _F]:
    """An option capping how many of ``what`` are shown."""
    return click.option(
        flag,
        dest,
        type=click.IntRange(min=minimum),
        default=default,
        show_default=True,
        help=f"Show at most this many {what}.",
    )


@redsem.command()
@click.argument("name", required=False)
@_pattern_option
@_at_most_option("--max", "max_count", 1, DEFAULT_MAX, "semaphores (sorted by name)")
@_at_most_option(
    "--waiters",
    "max_waiters",
    0,
    DEFAULT_WAITERS,
    "waiters of each semaphore, first in line first (text only)",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def status(
    ctx: click.Context,
    name: str | None,
    pattern: str | None,
    *,
    max_count: int,
    max_waiters: int,
    as_json: bool,
) -> None:
    """The semaphore NAME, those whose name matches --pattern, or (neither) every semaphore.

    For each: its limit, its holders (task id, fencing token, lease left), its waiters in the
    order they will be served (a grouped semaphore: its groups, with their holders, waiting,
    weight and share served), and the last fencing token granted; and, listed first, each rate
    limiter of the selection: its windows (rate, burst), next free time, booked slots, the
    units left of each window's burst, and a pause with its time left; with NAME, its running
    and pending runs (dedupe="coalesce"). Found with SCAN, never KEYS.
    A semaphore that cannot be read is skipped with a warning; the others are listed.
    """
    glob = _selection(name, pattern)
    target = _target(ctx)
    skipped: list[dict[str, str]] = []
    found, total = _run(
        lambda: states(
            target.client,
            prefix=target.prefix,
            pattern=glob,
            max_count=max_count,
            on_skip=_skipped_list(skipped),
        )
    )
    limiters = _run(lambda: rate_states(target.client, prefix=target.prefix, pattern=glob))
    groups = _run(lambda: groups_of(target.client, found, prefix=target.prefix))
    runs = name and _run(lambda: coalesce_state(target.client, name, prefix=target.prefix))
    if as_json:
        _print_json(
            {
                "prefix": target.prefix,
                "name": name,
                "pattern": glob,
                "total": total,
                "semaphores": [state_to_dict(s, groups[s.name]) for s in found],
                "rate_limiters": [asdict(r) for r in limiters],
                "runs": runs or None,
                "skipped": skipped,
            }
        )
        return
    for limiter in limiters:
        click.echo(_rate_line(ctx, limiter))
    if runs:
        click.echo(_runs_line(runs))
    if not total:
        if not limiters and not runs:
            click.echo(_none_found(target, name, glob))
        return
    pauses = {limiter.name: limiter.paused for limiter in limiters}
    for state in found:
        click.echo(_summary_line(ctx, state, pauses.get(state.name, 0.0)))
        waiting = group_lines(groups[state.name], _shown) or _waiter_lines(state, max_waiters)
        for line in _holder_lines(state) + waiting:
            click.echo(line)
    more = total - len(found) - len(skipped)
    if more > 0:
        click.echo(f"... and {more} more; narrow the selection or raise --max.")


@redsem.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def inspect(ctx: click.Context, name: str, as_json: bool) -> None:
    """Everything about the semaphore NAME, and the rate limiter NAME if it has one (rate,
    burst, next free time, booked slots). Exits with 1 if neither has keys in Redis."""
    target = _target(ctx)
    state = _run(lambda: read_state(target.client, name, prefix=target.prefix))
    groups = _run(lambda: groups_of(target.client, [state], prefix=target.prefix))[name]
    limiter = _run(lambda: read_rate_state(target.client, name, prefix=target.prefix))
    exists = state.limit is not None or bool(state.holders or state.waiters)
    limited = limiter.rate is not None or limiter.remembered > 0 or limiter.paused > 0
    keys = SemaphoreKeys(target.prefix, name)
    ttls = _run(lambda: _ttls(target.client, keys.all))
    rate_ttls = _run(lambda: _ttls(target.client, [keys.rate, keys.rate_line, keys.pause]))
    if as_json:
        _print_json(
            {
                **state_to_dict(state, groups),
                "exists": exists or limited,
                "key_ttls_ms": {**ttls, **rate_ttls},
                "rate_limiter": asdict(limiter) if limited else None,
            }
        )
    if exists and not as_json:
        click.echo(_summary_line(ctx, state, limiter.paused))
        _echo_ttls(ttls)
        click.echo(f"  holders ({len(state.holders)}, soonest lease end first)")
        click.echo("\n".join(_holder_lines(state)) or "    none")
        click.echo(f"  waiters ({len(state.waiters)}, in the order they will be served)")
        click.echo("\n".join(_waiter_lines(state)) or "    none")
        for line in group_lines(groups, _shown, heading=True):
            click.echo(line)
    if limited and not as_json:
        click.echo(_rate_line(ctx, limiter))
        _echo_ttls(rate_ttls)
        click.echo(f"  remembered ids {limiter.remembered} (admitted or booked, kept a while)")
    if not exists and not limited:
        if not as_json:
            click.echo(
                f"No semaphore {name!r} under prefix {target.prefix!r}, and no rate limiter.",
                err=True,
            )
        ctx.exit(1)


def _echo_ttls(ttls: dict[str, int]) -> None:
    for key, ttl in ttls.items():
        expiry = "has no TTL!" if ttl < 0 else f"expires in {_seconds(ttl)} unless used"
        click.echo(f"  key     {_shown(key)}  ({expiry})")


@redsem.command()
@click.argument("name")
@click.argument("permit_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def release(ctx: click.Context, name: str, permit_id: str, as_json: bool) -> None:
    """Force-release PERMIT_ID (a task id, as status shows it) from the semaphore NAME.

    For a holder known to be gone. The release is logged (with user and host). A task that is in
    fact still running finds its permit lost at its next heartbeat (or its release, if it ends
    first). Exits with 1 if PERMIT_ID neither held a permit nor waited in line.
    """
    target = _target(ctx)
    actor = f"{getpass.getuser()}@{socket.gethostname()}"
    result = _run(
        lambda: force_release(
            target.client,
            name,
            permit_id,
            prefix=target.prefix,
            idle_ttl=target.idle_ttl,
            actor=actor,
        )
    )
    if as_json:
        _print_json(
            {
                "name": result.name,
                "permit_id": result.permit_id,
                "released": result.released,
                "token": result.token,
            }
        )
    elif result.released == "holder":
        click.echo(
            f"Released the permit of {_shown(permit_id)} in {_shown(name)} (token {result.token})."
        )
    elif result.released == "waiter":
        click.echo(f"Removed {_shown(permit_id)} from the waiting line of {_shown(name)}.")
    else:
        click.echo(
            f"{_shown(permit_id)} holds no permit and no place in line of {_shown(name)}.",
            err=True,
        )
    if result.released == "none":
        ctx.exit(1)


@redsem.command()
@click.argument("name")
@click.argument("seconds", type=click.FloatRange(min=0, min_open=True, max=MAX_SECONDS))
@click.pass_context
def pause(ctx: click.Context, name: str, seconds: float) -> None:
    """Admit no start of NAME (rate limiter and semaphore) for SECONDS on any worker (a longer
    pause stays). Holders keep their permits; tasks wait, parked or retried (max_retries
    untouched), until it ends or `resume` ends it; none fails. Other names are untouched."""
    target = _target(ctx)
    left = _run(lambda: pause_rate_limiter(target.client, name, seconds, prefix=target.prefix))
    click.echo(f"{_shown(name)} is paused for {left:.3f}s.")


@redsem.command()
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    """End a pause of NAME (its rate limiter and its semaphore) now (its waiting tasks ask
    again within redsem_retry_backoff_max seconds)."""
    target = _target(ctx)
    _run(lambda: pause_rate_limiter(target.client, name, 0, prefix=target.prefix))
    click.echo(f"{_shown(name)} is not paused.")


@redsem.command(name="purge")
@click.argument("name", required=False)
@_pattern_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def purge_command(
    ctx: click.Context, name: str | None, pattern: str | None, yes: bool, as_json: bool
) -> None:
    """Delete every key of the semaphore NAME, of those matching --pattern, or (neither) of all.

    Asks first, showing how many semaphores and live holders would go. Running holders lose
    their permits. Found with SCAN, never KEYS. A semaphore whose state cannot be read is
    purged too (its holders are not counted).
    """
    glob = _selection(name, pattern)
    target = _target(ctx)
    found, total = _run(
        lambda: states(target.client, prefix=target.prefix, pattern=glob, on_skip=_skipped_list([]))
    )
    holders = sum(len(s.holders) for s in found)
    result = {"prefix": target.prefix, "name": name, "pattern": glob, "purged": 0}
    if not total:
        if as_json:
            _print_json(result)
        else:
            click.echo(_none_found(target, name, glob))
        return
    if not yes:
        what = (
            f"semaphore {name!r}" if name is not None else f"{total} semaphore(s) matching {glob!r}"
        )
        click.confirm(
            f"Delete all keys of {what} under prefix {target.prefix!r} on {target.url}, "
            f"taking {holders} live permit(s) away?",
            abort=True,
            err=True,
        )
    result["purged"] = _run(lambda: purge(target.client, prefix=target.prefix, pattern=glob))
    if as_json:
        _print_json(result)
    else:
        click.echo(f"Purged {result['purged']} semaphore(s).")
