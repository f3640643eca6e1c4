"""``fairserve audit``: the audit log (router/state/audit.py), oldest first.

    fairserve audit --since 7d
    fairserve audit --since 2026-12-01 --format json
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import TYPE_CHECKING

from cluster.tenants_cli import default_redis_url, run_with_redis
from cluster.usage_cli import parse_time
from router.state.audit import MAX_READ, AuditLog
from router.state.usage import iso

if TYPE_CHECKING:
    import redis.asyncio as aioredis


def add_audit_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    audit = sub.add_parser("audit", help="every administrative change: when, who, what, before "
                           "and after")
    audit.add_argument("--redis-url", default=default_redis_url(),
                       help="the Redis the routers share (as for `fairserve tenants`)")
    audit.add_argument("--since", default="30d", help="from: a time ago (24h, 7d) or a UTC date "
                       "or time (default 30d)")
    audit.add_argument("--until", default="now", help="to (default now)")
    audit.add_argument("--limit", type=int, default=1_000,
                       help=f"at most this many entries (up to {MAX_READ})")
    audit.add_argument("--format", choices=("table", "json"), default="table")
    audit.set_defaults(func=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    return run_with_redis(args, functools.partial(_print_audit, args))


async def _print_audit(args: argparse.Namespace, client: aioredis.Redis) -> int:
    now_ms = int(time.time() * 1000)
    entries = await AuditLog(client).read(parse_time(args.since, now_ms, "since"),
                                          parse_time(args.until, now_ms, "until"), args.limit)
    if args.format == "json":
        print(json.dumps([e.as_dict() for e in entries], indent=2))
        return 0
    for e in entries:
        print(f"{iso(e.time_ms)}  {e.actor}  {e.action}  {e.target}  "
              f"before={json.dumps(e.before)}  after={json.dumps(e.after)}")
    if not entries:
        print("no entries")
    return 0
