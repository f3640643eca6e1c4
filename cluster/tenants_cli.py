"""The ``fairserve tenants`` subcommands: tenants and their API keys, in the Redis the routers share;
and ``fairserve adapters`` (``add``, ``list``, ``remove``): LoRA adapters added at run time.

``add``, ``list``, ``set``, ``key-create``, ``key-revoke`` and ``load`` (a YAML file, see
``router.state.tenants``) and ``key-new`` (a key made and printed here, stored nowhere). Every
subcommand that talks to Redis takes ``--redis-url`` (default ``$FAIRSERVE_REDIS__URL``, else
the Redis of the ``fairserve up`` running from this directory, else the embedded default
``redis://127.0.0.1:6390/0``); the password may come from the environment or a mounted file,
as in the cluster's own processes. A change applies to the next request: the routers read a
tenant's settings on every admission. Errors print one ``error: ...`` line to stderr and exit 1
(argparse's usage errors exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import redis
import yaml

from cluster.admin_client import (
    AdminHttp,
    HttpKeys,
    HttpTenants,
    NoAdapters,
    add_admin_url_arguments,
)
from router.errors import InvalidRequestError, RouterError
from router.state.adapters import Adapter, AdapterRegistry
from router.state.api_keys import ApiKeys, digest, new_key
from router.state.audit import AuditLog, change_action, cli_actor
from router.state.redis_client import connect, with_env_password
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore, load_tenants, load_tenants_file, validated

if TYPE_CHECKING:
    import redis.asyncio as aioredis

# the settings tree's variable first (what a Ray pod of the Helm chart has), then the older name
REDIS_URL_ENVS = ("FAIRSERVE_REDIS__URL", "FAIRSERVE_REDIS_URL")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6390/0"  # the embedded Redis of `fairserve up`
REDIS_CONNECT_TIMEOUT_S = 5.0
EXIT_ERROR = 1
UNLIMITED = "-"

# Tenant fields the options set, in the order the table shows them.
SETTINGS = ("weight", "priority", "rpm", "tpm", "daily_tokens", "max_tokens", "max_queued",
            "max_streams", "max_resumes", "cache_group", "models", "disabled")
TABLE_COLUMNS = ("id", *SETTINGS, "keys")


@dataclass(frozen=True, slots=True)
class Admin:
    """What a subcommand works with: the stores, on one client of the shared Redis."""

    tenants: Any  # TenantStore, or HttpTenants over the admin API (cluster/admin_client.py)
    api_keys: Any  # ApiKeys, or HttpKeys
    adapters: Any  # AdapterRegistry (over the admin API: none)
    audit: AuditLog | None  # every change is written to it, by the CLI's user (over the admin
    actor: str = ""         # API: by the server, under the admin token)

    async def record(self, action: str, target: str, before: Any = None,
                     after: Any = None) -> None:
        if self.audit is not None:
            await self.audit.record(self.actor, action, target, before, after)


Command = Callable[[Admin, argparse.Namespace], Awaitable[int]]


# ---- the parser ----


def add_tenants_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``fairserve tenants ...`` on the top-level subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis-url", default=default_redis_url(),
        help="the Redis the routers share (default: $FAIRSERVE_REDIS__URL, else the Redis of the "
        f"`fairserve up` running from this directory, else {DEFAULT_REDIS_URL}); the password "
        "may come from $FAIRSERVE_REDIS__PASSWORD or the file $FAIRSERVE_REDIS__PASSWORD_FILE",
    )
    add_admin_url_arguments(common)
    tenants = sub.add_parser("tenants", help="add, list and change tenants and their API keys")
    commands = tenants.add_subparsers(dest="tenants_command", required=True)

    add = _command(commands, common, "add", "add a tenant (refused if the id exists)", _add)
    add.add_argument("tenant_id", metavar="ID")
    _add_settings_options(add, is_change=False)

    listing = _command(commands, common, "list", "list the tenants and their settings", _list)
    listing.add_argument("--json", action="store_true", help="print a JSON list")

    change = _command(commands, common, "set", "change some settings of a tenant", _set)
    change.add_argument("tenant_id", metavar="ID")
    _add_settings_options(change, is_change=True)

    create = _command(commands, common, "key-create", "create an API key (shown once)",
                      _key_create)
    create.add_argument("tenant_id", metavar="ID")
    create.add_argument("--label", default="", help="a note stored with the key")

    revoke = _command(commands, common, "key-revoke", "revoke an API key at once", _key_revoke)
    revoke.add_argument("tenant_id", metavar="ID")
    revoke.add_argument("key_id", metavar="KEY_ID")

    load = _command(commands, common, "load", "reconcile the tenants of a YAML file (settings "
                    "the file changed, its API key digests; keys it dropped are revoked)", _load)
    load.add_argument("path", metavar="FILE")
    load.add_argument("--prune", action="store_true",
                      help="also disable the tenants an earlier load of the file listed and it "
                      "no longer does (a deploy does; by hand, only with the whole file)")

    _add_adapters_parser(sub, common)

    new = commands.add_parser(
        "key-new", help="make a key here, store nothing; print its tenants-file entry",
        description="make a key here and print it, and its tenants-file entry (the digest "
        "only) for a Kubernetes Secret; nothing is stored")
    new.add_argument("tenant_id", metavar="ID")
    new.add_argument("--label", default="", help="a note stored with the key")
    new.set_defaults(func=key_new)


def _add_adapters_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                         common: argparse.ArgumentParser) -> None:
    """``fairserve adapters ...``: LoRA adapters added at run time (router/state/adapters.py)."""
    adapters = sub.add_parser("adapters", help="add, list and remove LoRA adapters")
    commands = adapters.add_subparsers(dest="adapters_command", required=True)
    add = _command(commands, common, "add", "add (or repoint) a LoRA adapter: a PEFT directory "
                   "every model replica can read, requested by its name as `model`", _adapter_add)
    add.add_argument("name", metavar="NAME")
    add.add_argument("path", metavar="PATH")
    add.add_argument("--tenant", default=None,
                     help="the only tenant that may use it (default: every tenant)")
    add.add_argument("--base", default=None, metavar="MODEL",
                     help="the base model it adapts, by its served name (default: the default "
                     "model); its replicas load it")
    listing = _command(commands, common, "list", "list the adapters added at run time",
                       _adapter_list)
    listing.add_argument("--json", action="store_true", help="print a JSON list")
    remove = _command(commands, common, "remove", "remove an adapter: refused from the next "
                      "request (replicas keep it loaded until it falls out of their LRU)",
                      _adapter_remove)
    remove.add_argument("name", metavar="NAME")


def default_redis_url() -> str:
    for name in REDIS_URL_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    state_dir = Path(os.environ.get("FAIRSERVE_STATE_DIR") or ".fairserve")
    try:  # the run state `fairserve up` writes (cluster/cli.py)
        url = json.loads((state_dir / "run.json").read_text()).get("redis_url")
    except (OSError, ValueError, AttributeError):
        url = None
    return str(url) if url else DEFAULT_REDIS_URL


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
    name: str,
    help_text: str,
    handler: Command,
) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, parents=[common], help=help_text, description=help_text)
    parser.set_defaults(func=run_tenants_command, handler=handler)
    return parser


def _add_settings_options(parser: argparse.ArgumentParser, is_change: bool) -> None:
    """The tenant settings; an option not given is absent from the namespace (SUPPRESS), so
    ``add`` keeps the model's defaults and ``set`` leaves the field as it is."""
    unset = argparse.SUPPRESS
    clear = " ('none': unlimited)"
    parser.add_argument("--weight", type=float, default=unset, metavar="W",
                        help="share of capacity under contention (default 1)")
    parser.add_argument("--priority", type=int, default=unset, metavar="P",
                        help="strict priority class 0-9; higher is served first (default 0)")
    parser.add_argument("--rpm", type=_limit, default=unset, metavar="N",
                        help="requests per minute" + clear)
    parser.add_argument("--tpm", type=_limit, default=unset, metavar="N",
                        help="tokens per minute (prompt + max_tokens)" + clear)
    parser.add_argument("--daily-tokens", type=_limit, default=unset, metavar="N",
                        help="token budget per UTC day" + clear)
    parser.add_argument("--max-tokens", type=int, default=unset, metavar="N",
                        help="cap on a request's max_tokens")
    parser.add_argument("--max-queued", type=int, default=unset, metavar="N",
                        help="cap on requests waiting in the tenant's queue")
    parser.add_argument("--max-streams", type=int, default=unset, metavar="N",
                        help="cap on requests the tenant's clients wait on at once")
    parser.add_argument("--max-resumes", type=int, default=unset, metavar="N",
                        help="cap on resumed reads (GET .../{id}) open at once")
    parser.add_argument("--models", type=_models, default=unset, metavar="M1,M2",
                        help="the models (base, adapters) the tenant may use ('none': every "
                        "model, the default)")
    parser.add_argument("--cache-group", type=_group, default=unset, metavar="NAME",
                        help="share the prefix cache with the tenants of this group ('none': "
                        "the tenant's own, the default)")
    if not is_change:
        parser.add_argument("--disabled", action="store_true", default=unset,
                            help="refuse the tenant's new requests")
        return
    switch = parser.add_mutually_exclusive_group()
    switch.add_argument("--enabled", dest="disabled", action="store_false", default=unset,
                        help="accept the tenant's new requests again")
    switch.add_argument("--disabled", dest="disabled", action="store_true", default=unset,
                        help="refuse the tenant's new requests (queued ones still run)")


def _limit(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _models(text: str) -> list[str] | None:
    return None if text.lower() == "none" else [m.strip() for m in text.split(",") if m.strip()]


def _group(text: str) -> str | None:
    return None if text.strip().lower() == "none" else text


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}


# ---- running a subcommand ----


def run_tenants_command(args: argparse.Namespace) -> int:
    if getattr(args, "admin_url", None):
        return run_with_admin_api(args, _over_http)
    return run_with_redis(args, functools.partial(_as_admin, args))


def run_with_admin_api(args: argparse.Namespace,
                       body: Callable[[AdminHttp, argparse.Namespace], Awaitable[int]]) -> int:
    """Runs ``body`` on the admin API at ``args.admin_url``; a refusal is an error line and
    exit status 1."""
    async def run() -> int:
        admin = AdminHttp(args)
        try:
            return await body(admin, args)
        finally:
            await admin.aclose()

    try:
        return asyncio.run(run())
    except RouterError as exc:
        return _fail(exc.message)


async def _over_http(http: AdminHttp, args: argparse.Namespace) -> int:
    handler: Command = args.handler
    return await handler(Admin(HttpTenants(http), HttpKeys(http), NoAdapters(), None), args)


def run_with_redis(args: argparse.Namespace,
                   body: Callable[[aioredis.Redis], Awaitable[int]]) -> int:
    """Runs ``body`` on a client of ``args.redis_url``; a refusal or an unreachable Redis is an
    error line and exit status 1."""
    try:
        return asyncio.run(_with_client(args, body))
    except RouterError as exc:
        return _fail(exc.message)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        return _fail(f"cannot reach Redis at {redacted_url(args.redis_url)}: {exc}")
    except redis.exceptions.RedisError as exc:
        return _fail(f"Redis at {redacted_url(args.redis_url)} answered an error: {exc}")


async def _with_client(args: argparse.Namespace,
                       body: Callable[[aioredis.Redis], Awaitable[int]]) -> int:
    try:
        client = connect(with_env_password(args.redis_url),
                         socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S)
    except ValueError as exc:
        raise InvalidRequestError(
            f"invalid --redis-url {redacted_url(args.redis_url)!r}: {exc}", param="redis_url"
        ) from None
    try:
        return await body(client)
    finally:
        await client.aclose()


async def _as_admin(args: argparse.Namespace, client: aioredis.Redis) -> int:
    scripts = Scripts(client)
    handler: Command = args.handler
    # the CLI knows no settings: a name the settings give an adapter wins over one added
    # here, and an adapter of a base model the cluster does not serve is never resolved
    adapters = AdapterRegistry(client, {})
    return await handler(Admin(TenantStore(scripts), ApiKeys(scripts), adapters,
                               AuditLog(client), cli_actor()), args)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_ERROR


def redacted_url(url: str) -> str:
    """The URL with its password masked, fit for an error message."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "<unparsable URL>"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


# ---- the subcommands ----


async def _add(admin: Admin, args: argparse.Namespace) -> int:
    tenant = _validated({"id": args.tenant_id, **_settings(args)})
    await admin.tenants.add(tenant)
    await admin.record("tenant.create", tenant.id, None, tenant.model_dump(mode="json"))
    print(f"added tenant {tenant.id}: {_describe(tenant, SETTINGS)}")
    return 0


async def _set(admin: Admin, args: argparse.Namespace) -> int:
    changes = _settings(args)
    if not changes:
        raise InvalidRequestError(
            "nothing to set: give at least one of --weight, --priority, --rpm, --tpm, "
            "--daily-tokens, --max-tokens, --max-queued, --max-streams, --max-resumes, "
            "--cache-group, --enabled, --disabled"
        )
    before = (await admin.tenants.get(args.tenant_id)).model_dump(mode="json")
    tenant = await admin.tenants.update(args.tenant_id, **changes)
    await admin.record(change_action(changes), tenant.id, before, tenant.model_dump(mode="json"))
    print(f"updated tenant {tenant.id}: {_describe(tenant, tuple(changes))}")
    return 0


async def _list(admin: Admin, args: argparse.Namespace) -> int:
    rows = [(t, len(await admin.api_keys.list(t.id))) for t in await admin.tenants.all()]
    if args.json:
        print(json.dumps([{**t.model_dump(), "num_keys": n} for t, n in rows], indent=2))
    elif not rows:
        print("no tenants")
    else:
        print(_table([[_cell(t, name) for name in TABLE_COLUMNS[:-1]] + [str(n)]
                      for t, n in rows]))
    return 0


async def _key_create(admin: Admin, args: argparse.Namespace) -> int:
    created = await admin.api_keys.create(args.tenant_id, label=args.label)
    await admin.record("key.create", created.tenant_id, None, {
        "key_id": created.key_id, "label": args.label, "digest": digest(created.secret)[:12]})
    # the key alone on stdout, so that KEY=$(fairserve tenants key-create ...) works
    print(created.secret)
    print(f"created key {created.key_id} for tenant {created.tenant_id}. Copy it now: it is not "
          "stored (only its SHA-256 digest is) and cannot be shown again.", file=sys.stderr)
    return 0


async def _key_revoke(admin: Admin, args: argparse.Namespace) -> int:
    await admin.tenants.get(args.tenant_id)  # an unknown tenant is named as such
    await admin.api_keys.revoke(args.tenant_id, args.key_id)
    await admin.record("key.revoke", args.tenant_id, {"key_id": args.key_id})
    print(f"revoked key {args.key_id} of tenant {args.tenant_id}: refused from the next request")
    return 0


async def _load(admin: Admin, args: argparse.Namespace) -> int:
    try:
        document = load_tenants_file(args.path)
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {args.path}: {exc.strerror or exc}",
                                  param="path") from None
    if not isinstance(admin.tenants, TenantStore):
        raise InvalidRequestError("tenants load needs --redis-url (a deploy loads the file "
                                  "itself: tenants.file)", param="admin_url")
    result = await load_tenants(admin.tenants.scripts, document, prune=args.prune,
                                audit=admin.audit, actor=f"{admin.actor} file:{args.path}")
    print(f"loaded {len(document.tenants)} tenants from {args.path}: {result.summary}")
    return 0


async def _adapter_add(admin: Admin, args: argparse.Namespace) -> int:
    # imported here: only this command checks adapter files (lora_files loads no torch)
    from replicas.engine.lora_files import AdapterError, check_adapter_dir

    path = Path(args.path).expanduser().absolute()
    if path.is_dir():  # checked here: a bad adapter is refused now, not at its first request
        try:
            files = check_adapter_dir(path, args.name)
        except AdapterError as exc:
            raise InvalidRequestError(str(exc), param="path") from None
        print(f"checked: rank {files.rank} on {', '.join(sorted(files.modules))} of "
              f"{files.num_layers} layers")
    else:
        print(f"warning: {path} is not a directory here, so it is not checked; every model "
              "replica must be able to read it", file=sys.stderr)
    if args.tenant is not None:
        await admin.tenants.get(args.tenant)  # an unknown tenant is named as such
    adapter = Adapter(args.name, str(path), args.tenant, base=args.base)
    await admin.adapters.add(adapter)
    await admin.record("adapter.add", args.name, None, asdict(adapter))
    print(f"adapter {args.name} -> {path}"
          + (f" on {args.base}" if args.base else " on the default model")
          + (f", for tenant {args.tenant} only" if args.tenant else ", for every tenant"))
    return 0


async def _adapter_list(admin: Admin, args: argparse.Namespace) -> int:
    adapters = await admin.adapters.visible(None)
    if args.json:
        print(json.dumps([asdict(a) for a in adapters], indent=2))
    elif not adapters:
        print("no adapters added")
    else:
        print(_table([[a.name, a.base or "(default)", a.owner or "*", a.path or ""]
                      for a in adapters], ("name", "base", "tenant", "path")))
    return 0


async def _adapter_remove(admin: Admin, args: argparse.Namespace) -> int:
    if not await admin.adapters.remove(args.name):
        raise InvalidRequestError(f"no adapter {args.name!r} was added", param="name")
    await admin.record("adapter.remove", args.name)
    print(f"removed adapter {args.name}")
    return 0


def key_new(args: argparse.Namespace) -> int:
    """A new key made here, stored nowhere: the key on stdout, its tenants-file entry (the
    digest) on stderr, for a Kubernetes Secret that bootstraps the tenants."""
    try:
        tenant_id = _validated({"id": args.tenant_id}).id
    except InvalidRequestError as exc:
        return _fail(exc.message)
    key_id, secret = new_key()
    print(secret)
    entry = yaml.safe_dump({"tenants": [{"id": tenant_id, "api_keys": [
        {"id": key_id, "sha256": digest(secret), "label": args.label}]}]}, sort_keys=False)
    print(f"key {key_id} for tenant {tenant_id}; nothing was stored. Its entry in a tenants "
          f"file (the digest only):\n{entry}", file=sys.stderr, end="")
    return 0


# ---- validation and display ----


def _validated(fields: dict[str, Any]) -> Tenant:
    tenant: Tenant = validated(Tenant, fields)
    return tenant


def _cell(tenant: Tenant, name: str) -> str:
    value = getattr(tenant, name)
    if value is None:
        return UNLIMITED
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def _describe(tenant: Tenant, names: tuple[str, ...]) -> str:
    return " ".join(f"{name}={_cell(tenant, name)}" for name in names)


def _table(rows: list[list[str]], columns: tuple[str, ...] = TABLE_COLUMNS) -> str:
    widths = [max(len(row[i]) for row in [list(columns), *rows]) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                     .rstrip() for row in [list(columns), *rows])
