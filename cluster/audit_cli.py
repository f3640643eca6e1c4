"""``fairserve audit``: the audit log (router/state/audit.py), oldest first; ``fairserve admin``:
the admin API's tokens (router/state/admin_tokens.py).

    fairserve audit --since 7d
    fairserve audit --since 2026-12-01 --format json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import yaml

from cluster.admin_client import AdminHttp, add_admin_url_arguments
from cluster.tenants_cli import default_redis_url, run_with_admin_api, run_with_redis
from cluster.usage_cli import parse_time
from router.state.admin_tokens import AdminTokens, new_token
from router.state.api_keys import digest
from router.state.audit import MAX_READ, AuditLog, cli_actor
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
    add_admin_url_arguments(audit)
    audit.set_defaults(func=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    if args.admin_url:
        return run_with_admin_api(args, _print_audit_over_http)
    return run_with_redis(args, functools.partial(_print_audit, args))


def _window(args: argparse.Namespace) -> tuple[int, int]:
    now_ms = int(time.time() * 1000)
    return parse_time(args.since, now_ms, "since"), parse_time(args.until, now_ms, "until")


async def _print_audit(args: argparse.Namespace, client: aioredis.Redis) -> int:
    since, until = _window(args)
    entries = await AuditLog(client).read(since, until, args.limit)
    _print_entries([e.as_dict() for e in entries], args.format)
    return 0


async def _print_audit_over_http(admin: AdminHttp, args: argparse.Namespace) -> int:
    since, until = _window(args)
    body = await admin.call("GET", "/admin/v1/audit", params={
        "since_ms": since, "until_ms": until, "limit": args.limit})
    _print_entries(body["data"], args.format)
    return 0


def _print_entries(entries: list[dict[str, Any]], fmt: str) -> None:
    if fmt == "json":
        print(json.dumps(entries, indent=2))
        return
    for e in entries:
        print(f"{iso(e['time_ms'])}  {e['actor']}  {e['action']}  {e['target']}  "
              f"before={json.dumps(e['before'])}  after={json.dumps(e['after'])}")
    if not entries:
        print("no entries")


def add_admin_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``fairserve admin token-create|token-list|token-revoke``: the admin API's tokens."""
    admin = sub.add_parser("admin", help="tokens of the admin API (router.api.admin_port)")
    commands = admin.add_subparsers(dest="admin_command", required=True)
    new = commands.add_parser("token-new", help="a new admin token made here and stored nowhere: "
                              "the token on stdout, its admin tokens file entry (the digest) on "
                              "stderr, for a Kubernetes Secret (admin.existingSecret)")
    new.add_argument("--label", default="", help="what it is for")
    new.set_defaults(func=_token_new)
    for name, text, func in (("token-create", "a new admin token, printed once", _token_create),
                             ("token-list", "the admin tokens (id, label, created)", _token_list),
                             ("token-revoke", "revoke an admin token by its id", _token_revoke)):
        command = commands.add_parser(name, help=text)
        command.add_argument("--redis-url", default=default_redis_url(),
                             help="the Redis the routers share (as for `fairserve tenants`)")
        if name == "token-create":
            command.add_argument("--label", default="", help="what it is for")
        if name == "token-revoke":
            command.add_argument("token_id", metavar="ID")
        command.set_defaults(func=functools.partial(_run_admin, func))


def _run_admin(func: Any, args: argparse.Namespace) -> int:
    return run_with_redis(args, functools.partial(func, args))


async def _token_create(args: argparse.Namespace, client: aioredis.Redis) -> int:
    token, secret = await AdminTokens(client).create(args.label)
    await AuditLog(client).record(cli_actor(), "admin_token.create", token.id, None,
                                  {"label": token.label})
    print(secret)  # alone on stdout: TOKEN=$(fairserve admin token-create)
    print(f"created admin token {token.id}. Copy it now: only its SHA-256 digest is stored.",
          file=sys.stderr)
    return 0


def _token_new(args: argparse.Namespace) -> int:
    token_id, secret = new_token()
    print(secret)
    entry = yaml.safe_dump({"admin_tokens": [{"id": token_id, "label": args.label,
                                              "sha256": digest(secret)}]}, sort_keys=False)
    print(f"admin token {token_id}; nothing was stored. Its entry in an admin tokens file "
          f"(the digest only):\n{entry}", file=sys.stderr, end="")
    return 0


async def _token_list(args: argparse.Namespace, client: aioredis.Redis) -> int:
    tokens = await AdminTokens(client).list()
    for t in tokens:
        print(f"{t.id}  {iso(t.created_ms)}  {t.label}")
    if not tokens:
        print("no admin tokens")
    return 0


async def _token_revoke(args: argparse.Namespace, client: aioredis.Redis) -> int:
    await AdminTokens(client).revoke(args.token_id)
    await AuditLog(client).record(cli_actor(), "admin_token.revoke", args.token_id)
    print(f"revoked admin token {args.token_id}")
    return 0
