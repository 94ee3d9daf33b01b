"""A stand-in for the game's marketplace API, which serves at most 5 concurrent calls per account.

A real marketplace would answer a sixth concurrent call with "429 Too Many Requests". This one
does the same (:class:`TooManyCalls`), and keeps its books in Redis so the demo and the tests can
count, independently of the semaphore, how many calls really ran at once per account.

It also shows how a storage system uses fencing tokens: :func:`store_report` refuses a write
whose token is older than the last one it accepted, so a report builder whose lock was lost
(a paused process, say) cannot overwrite a newer report.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from django.conf import settings

# Books expire a day after the last write: the example leaves no immortal key either.
BOOKS_TTL = 24 * 3600

_client: tuple[int, redis.Redis] | None = None


class TooManyCalls(Exception):
    """The marketplace refused a call: the account already had the maximum running."""


class StaleToken(Exception):
    """The store refused a write fenced with a token older than one it already accepted."""


def client() -> redis.Redis:
    """This process' client (a forked worker child makes its own, never reusing the parent's)."""
    global _client  # noqa: PLW0603
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(settings.REDIS_URL, decode_responses=True))
    return _client[1]


def key(*parts: str) -> str:
    """A key of the marketplace's books."""
    return ":".join((settings.MARKET_KEY_PREFIX, *parts))


def call(account_id: str, action: str, seconds: float) -> None:
    """One API call for ``account_id`` that takes ``seconds``; raise :class:`TooManyCalls` if the
    account already has the maximum number of calls running."""
    r = client()
    running = r.hincrby(key("running"), account_id, 1)
    _record(r, account_id, running)
    try:
        if running > settings.MARKET_MAX_CONCURRENT_CALLS:
            r.hincrby(key("rejected"), account_id, 1)
            raise TooManyCalls(f"{action} for {account_id}: {running} calls at once")
        time.sleep(seconds)
    finally:
        _record(r, account_id, r.hincrby(key("running"), account_id, -1))


def _record(r: redis.Redis, account_id: str, running: int) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.zadd(key("peak"), {account_id: running}, gt=True)
    pipe.rpush(key("events"), f"{time.time():.4f} {account_id} {running}")
    for name in ("running", "peak", "events"):
        pipe.expire(key(name), BOOKS_TTL)
    pipe.execute()


def purchase_done(account_id: str, waited: float, retries: int) -> None:
    """Book a finished purchase, how long it waited between enqueue and start, and how many
    contention retries it took."""
    r = client()
    pipe = r.pipeline(transaction=False)
    pipe.hincrby(key("done"), account_id, 1)
    pipe.hincrby(key("retries"), account_id, retries)
    pipe.expire(key("retries"), BOOKS_TTL)
    pipe.rpush(key("waits", account_id), f"{waited:.4f}")
    pipe.expire(key("done"), BOOKS_TTL)
    pipe.expire(key("waits", account_id), BOOKS_TTL)
    pipe.execute()


# Compare-and-set on the fencing token: the write goes through only with a token at least as new
# as the newest one seen.
_FENCED_SET = """
local last = tonumber(redis.call('HGET', KEYS[1], 'token') or '0')
if tonumber(ARGV[1]) < last then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'body', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


def store_report(day: str, token: int, body: str) -> None:
    """Store the report of ``day``, fenced by ``token``; raise :class:`StaleToken` if older."""
    if not client().eval(_FENCED_SET, 1, key("report", day), str(token), body, BOOKS_TTL):
        raise StaleToken(f"report {day}: token {token} is older than the stored one")


def publish_tick(account_id: str, token: int, tick: int) -> None:
    """Publish one market-feed tick for ``account_id``, fenced by the feed's ``token``."""
    if not client().eval(_FENCED_SET, 1, key("feed", account_id), str(token), str(tick), 600):
        raise StaleToken(f"feed {account_id}: token {token} is older than the stored one")


def record_feed(account_id: str, result: dict[str, Any]) -> None:
    """Book the outcome of a finished market feed stream."""
    r = client()
    r.hset(key("feed-result", account_id), mapping={k: str(v) for k, v in result.items()})
    r.expire(key("feed-result", account_id), BOOKS_TTL)


def feed_result(account_id: str) -> dict[str, str]:
    """The booked outcome of the last finished feed of ``account_id`` (empty if none)."""
    result: dict[str, str] = client().hgetall(key("feed-result", account_id))
    return result


def record_build(day: str, token: int, started: float, ended: float) -> None:
    """Book one build of the report of ``day``: its fencing token and when it ran."""
    r = client()
    r.rpush(key("builds", day), f"{token} {started:.4f} {ended:.4f}")
    r.expire(key("builds", day), BOOKS_TTL)


def builds(day: str) -> list[tuple[int, float, float]]:
    """Every booked build of the report of ``day``: (token, started, ended), in order."""
    out = []
    for line in client().lrange(key("builds", day), 0, -1):
        token, started, ended = line.split(" ")
        out.append((int(token), float(started), float(ended)))
    return out


def books(accounts: list[str]) -> dict[str, dict[str, Any]]:
    """Per account: calls running now, peak at once, done, rejected, retries and wait times."""
    r = client()
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(key("running"))
    pipe.zrange(key("peak"), 0, -1, withscores=True)
    pipe.hgetall(key("done"))
    pipe.hgetall(key("rejected"))
    pipe.hgetall(key("retries"))
    for account in accounts:
        pipe.lrange(key("waits", account), 0, -1)
    running, peak, done, rejected, retries, *waits = pipe.execute()
    peaks = {name: int(score) for name, score in peak}
    return {
        account: {
            "running": int(running.get(account, 0)),
            "peak": peaks.get(account, 0),
            "done": int(done.get(account, 0)),
            "rejected": int(rejected.get(account, 0)),
            "retries": int(retries.get(account, 0)),
            "waits": [float(w) for w in account_waits],
        }
        for account, account_waits in zip(accounts, waits, strict=True)
    }


def events() -> list[tuple[float, str, int]]:
    """Every change of a running-calls count: (time, account, calls running after it)."""
    out = []
    for line in client().lrange(key("events"), 0, -1):
        ts, account, running = line.split(" ")
        out.append((float(ts), account, int(running)))
    return out


def reset() -> None:
    """Forget the books (the demo starts from a clean slate on its own server)."""
    r = client()
    keys = list(r.scan_iter(match=key("*"), count=500))
    if keys:
        r.delete(*keys)
