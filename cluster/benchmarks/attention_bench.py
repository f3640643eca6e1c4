"""The CPU kernels' paged attention, a tile of rows at a time against row by row, in one run.

    python -m cluster.benchmarks.attention_bench [--depths 0,1024,2048,4096,7680]
        [--chunk 512] [--threads 1] [--repeats 5]

SmolLM2-135M's attention shape (9 query heads on 3 KV heads of 64, blocks of 16 tokens, one
layer), bfloat16: for each depth, a prefill chunk of ``--chunk`` rows continuing a sequence
that already holds ``depth`` tokens, and one decode row after it, through
``torch.ops.fairserve.paged_attention`` tiled (the engine's path) and with ``by_rows`` (every
row alone, as before the tiles). Median of ``--repeats`` per cell, the ratio, and whether the
two gave the same bits (they must: a migrated request resumes to its exact text only if a row's
result never depends on the path). The model's other work in a step (the projections, ~1 s for
512 rows of the 30 layers on one core here) is not in these figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.benchmarks.peer_bench import cpu_name
from replicas.torch_engine.kernels import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
NUM_LAYERS = 30  # SmolLM2-135M's: what a step's attention costs is 30 of these


class Sequence:
    """One sequence's paged cache (its blocks in a shuffled order, as a busy cache has them)."""

    def __init__(self, max_len: int) -> None:
        num_blocks = -(-max_len // BLOCK)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.k = torch.zeros(shape, dtype=torch.bfloat16)
        self.v = torch.zeros(shape, dtype=torch.bfloat16)
        self.table = torch.randperm(num_blocks).long().view(1, -1).contiguous()
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * (
            1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.cos, self.sin = freqs.cos().contiguous(), freqs.sin().contiguous()
        self.qkv = torch.randn(max_len, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(torch.bfloat16)

    def run(self, start: int, num_rows: int, by_rows: bool = False) -> torch.Tensor:
        """Rows ``start .. start + num_rows`` (their keys written, then attended)."""
        pos = torch.arange(start, start + num_rows, dtype=torch.long)
        slots = (self.table[0, pos // BLOCK] * BLOCK + pos % BLOCK).contiguous()
        seq = torch.zeros(num_rows, dtype=torch.long)
        return torch.ops.fairserve.paged_attention(
            self.qkv[start : start + num_rows].contiguous(), pos, self.cos, self.sin, self.k,
            self.v, slots, seq, self.table, HEADS, KV_HEADS, 0, HEAD_DIM ** -0.5, by_rows)


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def depth_list(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers") from None
    if any(d < 0 for d in depths):
        raise argparse.ArgumentTypeError(f"{text!r}: depths cannot be negative")
    return depths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=depth_list, default="0,1024,2048,4096,7680",
                        help="tokens already in the cache, comma-separated")
    parser.add_argument("--chunk", type=positive, default=512)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--repeats", type=positive, default=5)
    args = parser.parse_args()
    status = cpu_ops()
    if not status.is_available:
        raise SystemExit(f"the CPU kernels are not available here: {status.detail}")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    depths = args.depths
    seq = Sequence(max(depths) + args.chunk + 1)
    # every depth's keys in the cache (written by the kernel itself, a chunk at a time)
    for start in range(0, max(depths), args.chunk):
        seq.run(start, min(args.chunk, max(depths) - start))
    print(f"CPU: {cpu_name()}; {args.threads} thread(s); bfloat16, {HEADS} heads on {KV_HEADS} "
          f"KV heads of {HEAD_DIM}; median of {args.repeats}; one layer (a step runs "
          f"{NUM_LAYERS})\n")
    print(f"{'depth':>6} | {'rows':>5} | {'by rows ms':>10} | {'tiles ms':>8} | "
          f"{'speed-up':>8} | {'same bits':>9}")
    print("-" * 62)
    for depth in depths:
        for num_rows in (args.chunk, 1):
            same = torch.equal(seq.run(depth, num_rows), seq.run(depth, num_rows, by_rows=True))
            rows_s = timed(lambda d=depth, n=num_rows: seq.run(d, n, by_rows=True), args.repeats)
            tiles_s = timed(lambda d=depth, n=num_rows: seq.run(d, n), args.repeats)
            print(f"{depth:>6} | {num_rows:>5} | {rows_s * 1000:>10.2f} | {tiles_s * 1000:>8.2f} | "
                  f"{rows_s / tiles_s:>7.2f}x | {'yes' if same else 'NO':>9}")


if __name__ == "__main__":
    main()
