"""The ``fairserve`` command line: ``up``, ``down``, ``status`` and ``tenants ...``.

``fairserve up`` runs in the foreground (Ctrl-C, or ``fairserve down`` from another shell,
stops it): it starts the embedded Redis (or uses ``--redis-url``), a local Ray (or joins
``--ray-address``), the Serve application with the model, creates a demo tenant and key when
there is no tenant, and prints the base URL, the key and working ``curl`` and ``openai``
snippets. Its run state (pid, URLs) is kept in ``<state_dir>/run.json`` for ``down``/``status``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.audit_cli import add_admin_parser, add_audit_parser
from cluster.errors import ClusterStartError
from cluster.tenants_cli import add_tenants_parser
from cluster.usage_cli import add_usage_parser
from router.state.redis_client import RedisNotReadyError

if TYPE_CHECKING:
    from cluster.settings import FairserveSettings

RUN_FILE = "run.json"
DEFAULT_STATE_DIR = Path(".fairserve")  # as cluster.settings; imported lazily (it loads torch)
STATE_DIR_ENV = "FAIRSERVE_STATE_DIR"
DOWN_TIMEOUT_S = 120.0


def _settings(args: argparse.Namespace) -> FairserveSettings:
    from cluster.settings import load_settings

    overrides: dict[str, Any] = {}

    def put(branch: str, name: str, value: Any) -> None:
        if value is not None:
            overrides.setdefault(branch, {})[name] = value

    put("router", "host", args.host)
    put("router", "port", args.port)
    put("router", "num_replicas", args.routers)
    put("replicas", "num_replicas", args.replicas)
    put("engine", "model", args.model)
    put("engine", "num_threads", args.threads)
    put("redis", "url", args.redis_url)
    put("ray", "address", args.ray_address)
    if args.state_dir is not None:
        overrides["state_dir"] = args.state_dir
    return load_settings(args.config, **overrides)


def _up(args: argparse.Namespace) -> int:
    from cluster.launcher import LocalCluster

    settings = _settings(args)
    running = _run_state_in(settings.state_dir)
    if running is not None and _is_running(int(running["pid"])):
        print(f"fairserve: already running (pid {running['pid']}, {running['base_url']}) with "
              f"the state in {settings.state_dir}; `fairserve down` stops it", file=sys.stderr)
        return 1
    cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
    stop = threading.Event()
    try:
        info = cluster.start()
        # after start: ray.init installs its own SIGTERM handler
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        run_file = settings.state_dir / RUN_FILE
        run_file.write_text(json.dumps({"pid": os.getpid(), "base_url": info.base_url,
                                        "redis_url": info.redis_url,
                                        "ray_address": info.ray_address,
                                        "metrics_url": info.metrics_url}))
        _print_welcome(info.base_url, info.demo_key, settings.engine.served_model_name,
                       info.metrics_url)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        cluster.stop()
        (settings.state_dir / RUN_FILE).unlink(missing_ok=True)
    return 0


def _print_welcome(base: str, key: str | None, model: str, metrics: str) -> None:
    shown_key = key or "<your key: fairserve tenants key-create TENANT>"
    print(f"\nbase URL: {base}\nAPI key:  {shown_key}\n")
    print(f"  curl {base}/chat/completions -H 'Authorization: Bearer {shown_key}' \\\n"
          f"    -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": "
          f"[{{\"role\": \"user\", \"content\": \"Which city is the capital of France?\"}}]}}'\n")
    print(f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}', "
          f"api_key='{shown_key}'); print(c.chat.completions.create(model='{model}', "
          f"messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)\"\n")
    if metrics:
        print(f"Prometheus metrics (operators only, not the API's port): {metrics}\n")
    print("Ctrl-C or `fairserve down` stops it.", flush=True)


def _state_dir(args: argparse.Namespace) -> Path:
    """The state directory ``fairserve up`` used, found as it found it: ``--state-dir``, else
    ``$FAIRSERVE_STATE_DIR``, else the settings file's ``state_dir`` (relative to that file),
    else ``.fairserve`` here. Read without the settings tree, which imports torch (the rule of
    ``replicas.engine.local_path``, inlined)."""

    def absolute(path: str | Path, base: Path | None = None) -> Path:
        return Path(os.path.abspath((base or Path.cwd()) / Path(path).expanduser()))

    if args.state_dir is not None:
        return absolute(args.state_dir)
    if os.environ.get(STATE_DIR_ENV):
        return absolute(os.environ[STATE_DIR_ENV])
    if args.config is not None:
        import yaml

        with open(args.config) as f:
            document = yaml.safe_load(f) or {}
        if isinstance(document, dict) and document.get("state_dir"):
            return absolute(str(document["state_dir"]), Path(args.config).resolve().parent)
    return absolute(DEFAULT_STATE_DIR)


def _run_state(args: argparse.Namespace) -> dict[str, Any] | None:
    return _run_state_in(_state_dir(args))


def _run_state_in(state_dir: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((state_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state


def _down(args: argparse.Namespace) -> int:
    state = _run_state(args)
    if state is None:
        print(f"fairserve is not running (no run state in {_state_dir(args)})", file=sys.stderr)
        return 1
    pid = int(state["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print(f"fairserve (pid {pid}) is not running", file=sys.stderr)
        return 1
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _is_running(pid):
            print("stopped")
            return 0
        time.sleep(0.5)
    print(f"fairserve (pid {pid}) did not stop within {DOWN_TIMEOUT_S:.0f} s", file=sys.stderr)
    return 1


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _status(args: argparse.Namespace) -> int:
    from cluster.status import print_status

    state = _run_state(args)
    if state is None:
        print(f"fairserve is not running (no run state in {_state_dir(args)})")
        return 1
    return asyncio.run(print_status(state["base_url"], state["redis_url"]))


def _top(args: argparse.Namespace) -> int:
    from cluster.top import run_top

    redis_url = args.redis_url
    if redis_url is None:
        state = _run_state(args)
        if state is None:
            print("fairserve is not running (no run state); pass --redis-url", file=sys.stderr)
            return 1
        redis_url = state["redis_url"]
    try:
        return asyncio.run(run_top(redis_url, args.interval, args.once))
    except KeyboardInterrupt:
        return 0


def _add_state_dir_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--state-dir", type=Path, default=None,
                         help=f"as given to `fairserve up` (default: ${STATE_DIR_ENV}, the "
                         "settings file's state_dir, else .fairserve)")
    command.add_argument("--config", default=None,
                         help="the settings file given to `fairserve up` (for its state_dir)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="fairserve",
                                     description="fairserve: multi-tenant LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the cluster here (foreground)")
    up.add_argument("--config", default=None, help="settings YAML file")
    up.add_argument("--host", default=None)
    up.add_argument("--port", type=int, default=None)
    up.add_argument("--model", default=None, help="a GGUF file or a Hugging Face directory")
    up.add_argument("--threads", type=int, default=None, help="torch threads per replica")
    up.add_argument("--replicas", type=int, default=None, help="model replicas")
    up.add_argument("--routers", type=int, default=None, help="router replicas")
    up.add_argument("--redis-url", default=None, help="use this Redis, not the embedded one")
    up.add_argument("--ray-address", default=None, help="join this Ray cluster")
    up.add_argument("--state-dir", type=Path, default=None)
    up.set_defaults(func=_up)
    for name, func, text in (("down", _down, "stop the cluster `fairserve up` started"),
                             ("status", _status, "replicas, tenants and queues")):
        cmd = sub.add_parser(name, help=text)
        _add_state_dir_arguments(cmd)
        cmd.set_defaults(func=func)
    top = sub.add_parser("top", help="live view of tenants and replicas")
    _add_state_dir_arguments(top)
    top.add_argument("--redis-url", default=None, help="the cluster's Redis (default: the one "
                     "`fairserve up` runs)")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one frame (after --interval "
                     "seconds, to measure rates) and exit")
    top.set_defaults(func=_top)
    add_tenants_parser(sub)
    add_usage_parser(sub)
    add_audit_parser(sub)
    add_admin_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:  # settings errors name the field
        print(f"fairserve: {exc}", file=sys.stderr)
        return 2
    except (ClusterStartError, RedisNotReadyError) as exc:  # they say what to change
        print(f"fairserve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
