"""What a chaos test saw, said in full when it fails: the phase and its timeline (seconds from
the phase's start), every stream's figures beside its reference, the end of ``fairserve up``'s
output, and the cluster's Ray Serve logs kept beside the test's files. A failure that happened
once in many runs must explain itself from the report alone."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos.factories import StreamResult
from tests.cluster.factories import UpProcess

RAY_SESSIONS = Path("/tmp/ray")
MAX_LOG_BYTES = 20 * 1024 * 1024
NUM_OUTPUT_LINES = 40


@dataclass
class PhaseReport:
    """A test's phases, in order; the streams of the current one and their references."""

    tmp_path: Path
    up: UpProcess
    expected: list[str] = field(default_factory=list)
    results: list[StreamResult] = field(default_factory=list)
    phase: str = "start"
    timeline: list[str] = field(default_factory=list)
    started_s: float = field(default_factory=time.monotonic)

    def begin(self, phase: str) -> None:
        self.phase, self.results, self.started_s = phase, [], time.monotonic()
        self.timeline.append(f"--- {phase}")

    def mark(self, event: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.started_s:8.2f}s  {event}")

    def explain(self, why: str) -> str:
        lines = [why, f"phase: {self.phase}", "timeline:", *self.timeline, "streams:"]
        lines += [stream_line(i, r, self.expected[i] if i < len(self.expected) else None)
                  for i, r in enumerate(self.results)]
        lines += [f"fairserve up's last {NUM_OUTPUT_LINES} lines:",
                  *(x.rstrip() for x in self.up.lines[-NUM_OUTPUT_LINES:]),
                  f"cluster logs: {self.tmp_path / 'ray-logs'}"]
        return "\n".join(lines)


def stream_line(i: int, result: StreamResult, expected: str | None) -> str:
    """One stream: status, ends, tokens, errors, and where its text leaves the reference."""
    tokens = result.usage.get("completion_tokens") if result.usage else None
    if expected is None or result.text == expected:
        same = "text ok"
    else:
        at = next((j for j, (a, b) in enumerate(zip(result.text, expected, strict=False)) if a != b),
                  min(len(result.text), len(expected)))
        same = (f"text differs at char {at} of {len(expected)}: got {result.text[at:at + 30]!r}"
                f" want {expected[at:at + 30]!r}")
    return (f"  [{i:2d}] status={result.status} done={result.num_done} "
            f"finish={result.finish_reasons} chars={len(result.text)} tokens={tokens} "
            f"events={len(result.events)} errors={result.errors} {same}")


def keep_cluster_logs(tmp_path: Path, up_pid: int) -> Path | None:
    """Copy the Ray Serve logs of the cluster's Ray session (named for the process that
    started it, ``fairserve up``; else the newest) into ``tmp_path/ray-logs`` (pytest keeps
    the last runs' temporary folders). None when no session is found."""
    sessions = sorted(RAY_SESSIONS.glob("session_2*"), key=lambda p: p.stat().st_mtime)
    own = [p for p in sessions if p.name.endswith(f"_{up_pid}")]
    if not sessions:
        return None
    logs = (own or sessions)[-1] / "logs"
    target = tmp_path / "ray-logs"
    target.mkdir(exist_ok=True)
    for path in [*logs.glob("serve/*"), *logs.glob("worker-*.err"), *logs.glob("raylet.*")]:
        if path.is_file() and path.stat().st_size <= MAX_LOG_BYTES:
            shutil.copy2(path, target / path.name)
    return target
