"""``fairserve usage``: the usage records (router/state/usage.py) as a table, CSV or JSON.

    fairserve usage                                  # the last 24 h, by tenant, model and hour
    fairserve usage --since 7d --group-by tenant,day --format csv > usage.csv
    fairserve usage --since 2026-12-01 --until 2026-12-02 --tenant acme --format json

``--since`` and ``--until`` take a time ago (``90m``, ``24h``, ``7d``) or a UTC date or time
(``2026-12-01``, ``2026-12-01T10:00``); records are hourly, so an hour is in when it overlaps.
"""

from __future__ import annotations

import argparse
import functools
import re
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cluster.admin_client import AdminHttp, add_admin_url_arguments
from cluster.tenants_cli import default_redis_url, run_with_admin_api, run_with_redis
from router.errors import InvalidRequestError
from router.state.usage import GROUPS, UsageReader, render, render_dicts

if TYPE_CHECKING:
    import redis.asyncio as aioredis

AGO = re.compile(r"^(\d+)([mhd])$")
UNIT_MS = {"m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_time(text: str, now_ms: int, param: str) -> int:
    """ms since the epoch of a time ago (``24h``), ``now``, or a UTC ISO date or time."""
    if text == "now":
        return now_ms
    found = AGO.match(text)
    if found:
        return now_ms - int(found[1]) * UNIT_MS[found[2]]
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequestError(f"--{param}: {text!r} is not a time ago (24h, 7d, 90m) or a "
                                  "UTC date or time (2026-12-01, 2026-12-01T10:00)",
                                  param=param) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def add_usage_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    usage = sub.add_parser("usage", help="requests, tokens, times and errors per tenant, model "
                           "and hour (table, CSV, JSON)")
    usage.add_argument("--redis-url", default=default_redis_url(),
                       help="the Redis the routers share (as for `fairserve tenants`)")
    usage.add_argument("--since", default="24h", help="from (default 24h ago)")
    usage.add_argument("--until", default="now", help="to (default now)")
    usage.add_argument("--tenant", action="append", default=None,
                       help="only this tenant (repeatable)")
    usage.add_argument("--group-by", default="tenant,model,hour",
                       help=f"comma-separated of {', '.join(GROUPS)} (hour or day, not both)")
    usage.add_argument("--format", choices=("table", "csv", "json"), default="table")
    add_admin_url_arguments(usage)
    usage.set_defaults(func=run_usage)


def run_usage(args: argparse.Namespace) -> int:
    if args.admin_url:
        return run_with_admin_api(args, _print_usage_over_http)
    return run_with_redis(args, functools.partial(_print_usage, args))


def _window(args: argparse.Namespace) -> tuple[int, int, list[str]]:
    now_ms = int(time.time() * 1000)
    group_by = [g.strip() for g in args.group_by.split(",") if g.strip()]
    return (parse_time(args.since, now_ms, "since"), parse_time(args.until, now_ms, "until"),
            group_by)


async def _print_usage(args: argparse.Namespace, client: aioredis.Redis) -> int:
    since, until, group_by = _window(args)
    rows = await UsageReader(client).read(since, until, args.tenant, group_by)
    print(render(rows, group_by, args.format), end="")
    return 0


async def _print_usage_over_http(admin: AdminHttp, args: argparse.Namespace) -> int:
    since, until, group_by = _window(args)
    body = await admin.call("GET", "/admin/v1/usage", params={
        "since_ms": since, "until_ms": until, "tenant": args.tenant or [],
        "group_by": ",".join(group_by)})
    print(render_dicts(body["data"], group_by, args.format), end="")
    return 0
