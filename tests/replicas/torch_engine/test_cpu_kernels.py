"""fairserve's CPU kernels (replicas/torch_engine/kernels/cpu_ops.cpp) against slow torch
references, and the property they exist for: a row's result does not depend on the rows around it, nor on
how its sequence was cut into prefill chunks and decode steps."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from replicas.torch_engine.kernels import cpu_ops
from replicas.torch_engine.models.llama import RMSNorm

STATUS = cpu_ops()
pytestmark = pytest.mark.skipif(not STATUS.is_available, reason=STATUS.detail)
DTYPES = [torch.float32, torch.bfloat16]
BLOCK = 4


def _close(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_the_residual_add(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for hidden in (576, 100):  # 100: not a multiple of the kernel's 16 lanes
        norm = RMSNorm(hidden, 1e-5).to(dtype)
        norm.weight.data = torch.randn(hidden).to(dtype)
        x, delta = torch.randn(7, hidden).to(dtype), torch.randn(7, hidden).to(dtype)
        torch.testing.assert_close(torch.ops.fairserve.rms_norm(x, norm.weight, 1e-5), norm(x),
                                   **_close(dtype))
        residual = x.clone()
        out = torch.ops.fairserve.add_rms_norm(residual, delta, norm.weight, 1e-5)
        assert torch.equal(residual, x + delta)  # in place, rounded as torch's add
        torch.testing.assert_close(out, norm(x + delta), **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(5, 2 * 1000) * 6).to(dtype)  # large |g|: both branches of sigmoid
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.fairserve.silu_mul(gate_up).float(), F.silu(gate) * up,
                               **_close(dtype))


class Cache:
    """A paged KV cache with random block tables, and the reference arithmetic over it."""

    def __init__(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                 num_seqs: int, max_len: int, window: int = 0) -> None:
        self.dtype, self.heads, self.kv_heads, self.head_dim = dtype, heads, kv_heads, head_dim
        self.window = window
        blocks_per_seq = -(-max_len // BLOCK)
        num_blocks = num_seqs * blocks_per_seq + 3
        self.k = torch.zeros(num_blocks, BLOCK, kv_heads, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        order = torch.randperm(num_blocks)[: num_seqs * blocks_per_seq]
        self.tables = order.view(num_seqs, blocks_per_seq).long().contiguous()
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * (
            1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.cos, self.sin = freqs.cos().contiguous(), freqs.sin().contiguous()

    def run(self, qkv: torch.Tensor, seqs: list[int], positions: list[int],
            by_rows: bool = False) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.long)
        seq = torch.tensor(seqs, dtype=torch.long)
        slots = self.tables[seq, pos // BLOCK] * BLOCK + pos % BLOCK
        return torch.ops.fairserve.paged_attention(
            qkv.contiguous(), pos, self.cos, self.sin, self.k, self.v, slots.contiguous(), seq,
            self.tables, self.heads, self.kv_heads, self.window, self.head_dim ** -0.5, by_rows)

    def reference(self, qkv: torch.Tensor, seqs: list[int], positions: list[int],
                  roped_keys: dict[tuple[int, int], torch.Tensor],
                  values: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        """float64 attention over every (sequence, position) key seen so far."""
        D, group = self.head_dim, self.heads // self.kv_heads
        q_all, k_new, v_new = qkv.double().split(
            [self.heads * D, self.kv_heads * D, self.kv_heads * D], dim=-1)
        for t, (s, p) in enumerate(zip(seqs, positions, strict=True)):
            roped_keys[s, p] = self._rope(k_new[t].view(self.kv_heads, D), p)
            values[s, p] = v_new[t].view(self.kv_heads, D)
        out = torch.empty(len(seqs), self.heads, D, dtype=torch.float64)
        for t, (s, p) in enumerate(zip(seqs, positions, strict=True)):
            q = self._rope(q_all[t].view(self.heads, D), p)
            lo = max(0, p - self.window + 1) if self.window else 0
            keys = torch.stack([roped_keys[s, j] for j in range(lo, p + 1)])  # (n, kv, D)
            vals = torch.stack([values[s, j] for j in range(lo, p + 1)])
            for h in range(self.heads):
                scores = keys[:, h // group] @ q[h] / math.sqrt(D)
                out[t, h] = torch.softmax(scores, 0) @ vals[:, h // group]
        return out.view(len(seqs), -1)

    def _rope(self, x: torch.Tensor, p: int) -> torch.Tensor:
        half = self.head_dim // 2
        c, s = self.cos[p].double(), self.sin[p].double()
        x1, x2 = x[..., :half], x[..., half:]
        # rounded to the model's dtype, as the kernel stores it
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(self.dtype).double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,window", [(64, 0), (40, 0), (64, 5)])
def test_paged_attention_matches_the_reference(dtype: torch.dtype, head_dim: int,
                                               window: int) -> None:
    """Prefills from position 0, a chunk continuing a prefix, and decodes of 3 sequences, with
    a sliding window or none, against float64 attention."""
    torch.manual_seed(2)
    cache = Cache(dtype, heads=6, kv_heads=2, head_dim=head_dim, num_seqs=3, max_len=40,
                  window=window)
    keys: dict = {}
    values: dict = {}
    width = (6 + 2 * 2) * head_dim
    steps = [
        ([0] * 9 + [1] * 5, list(range(9)) + list(range(5))),  # two fresh prefills
        ([1] * 6 + [2] * 3, list(range(5, 11)) + list(range(3))),  # a continued chunk, a new one
        ([0, 1, 2], [9, 11, 3]),  # three decodes
    ]
    for seqs, positions in steps:
        qkv = torch.randn(len(seqs), width).to(dtype)
        out = cache.run(qkv, seqs, positions)
        expected = cache.reference(qkv, seqs, positions, keys, values)
        torch.testing.assert_close(out.double(), expected, **_close(dtype))
    for (s, p), key in keys.items():  # the cache holds the roped keys at each token's slot
        block = cache.tables[s, p // BLOCK]
        torch.testing.assert_close(cache.k[block, p % BLOCK].double(), key, **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_its_batch_or_chunking(dtype: torch.dtype) -> None:
    """Sequence 0's 30 tokens computed (a) in one prefill alone and (b) as chunks of 11 and 12
    beside other sequences' rows, then 7 decode steps in batches of other sizes: every output
    row and every cached key is bit for bit the same."""
    torch.manual_seed(3)
    heads, kv_heads, D = 9, 3, 64
    width = (heads + 2 * kv_heads) * D
    tokens = torch.randn(30, width).to(dtype)
    others = torch.randn(60, width).to(dtype)
    alone = Cache(dtype, heads, kv_heads, D, num_seqs=3, max_len=40)
    mixed = Cache(dtype, heads, kv_heads, D, num_seqs=3, max_len=40)
    mixed.tables = alone.tables.clone()
    out_alone = alone.run(tokens, [0] * 30, list(range(30)))
    pieces = []
    # chunk 1 after another sequence's 8-token prefill
    out = mixed.run(torch.cat([others[:8], tokens[:11]]), [1] * 8 + [0] * 11,
                    list(range(8)) + list(range(11)))
    pieces.append(out[8:])
    # chunk 2 with a decode of sequence 1 before it and a prefill of sequence 2 after it
    out = mixed.run(torch.cat([others[8:9], tokens[11:23], others[9:14]]),
                    [1] + [0] * 12 + [2] * 5, [8, *range(11, 23), *range(5)])
    pieces.append(out[1:13])
    for i, p in enumerate(range(23, 30)):  # decodes among 1 to 3 sequences
        rows = [tokens[p : p + 1], others[14 + 2 * i : 15 + 2 * i], others[15 + 2 * i : 16 + 2 * i]]
        n = 1 + i % 3
        out = mixed.run(torch.cat(rows[:n]), [0, 1, 2][:n], [p, 9 + i, 5 + i][:n])
        pieces.append(out[:1])
    assert torch.equal(torch.cat(pieces), out_alone)
    for p in range(30):
        block, offset = alone.tables[0, p // BLOCK], p % BLOCK
        assert torch.equal(mixed.k[block, offset], alone.k[block, offset])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 5, 21])
def test_the_tiles_give_the_row_by_row_bits(dtype: torch.dtype, window: int) -> None:
    """A long chunk is attended 8 rows at a time (16 keys widened once for all their queries);
    every row must be bit for bit what the row-by-row path gives: prefills of many lengths
    (tiles cut at 8 rows and at each sequence), a chunk continuing a prefix, decodes, windows."""
    torch.manual_seed(5)
    heads, kv_heads, D = 9, 3, 64
    width = (heads + 2 * kv_heads) * D
    cache = Cache(dtype, heads, kv_heads, D, num_seqs=4, max_len=120, window=window)
    steps = [
        ([0] * 37 + [1] * 9 + [2] * 1, list(range(37)) + list(range(9)) + [0]),
        ([1] * 70 + [3] * 17 + [0], list(range(9, 79)) + list(range(17)) + [37]),
        ([0, 1, 2, 3], [38, 79, 1, 17]),
        ([2] * 100, list(range(2, 102))),
    ]
    for seqs, positions in steps:
        qkv = torch.randn(len(seqs), width).to(dtype)
        by_rows = cache.run(qkv, seqs, positions, by_rows=True)
        tiled = cache.run(qkv, seqs, positions)
        assert torch.equal(tiled, by_rows)


def test_rms_norm_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(4)
    x = torch.randn(33, 576).to(torch.bfloat16)
    weight = torch.randn(576).to(torch.bfloat16)
    whole = torch.ops.fairserve.rms_norm(x, weight, 1e-5)
    for rows in (slice(0, 1), slice(5, 6), slice(10, 27)):
        assert torch.equal(torch.ops.fairserve.rms_norm(x[rows].contiguous(), weight, 1e-5),
                           whole[rows])


def test_bad_arguments_are_refused_with_the_reason() -> None:
    cache = Cache(torch.float32, heads=4, kv_heads=2, head_dim=16, num_seqs=1, max_len=8)
    qkv = torch.randn(2, (4 + 2 * 2) * 16)
    with pytest.raises(RuntimeError, match="qkv width"):
        cache.run(qkv[:, :-16], [0, 0], [0, 1])
    with pytest.raises(RuntimeError, match="cache dtype"):
        cache.run(qkv.bfloat16(), [0, 0], [0, 1])
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.fairserve.paged_attention(
            qkv, torch.tensor([0, 1], dtype=torch.int32), cache.cos, cache.sin, cache.k, cache.v,
            torch.tensor([0, 1]), torch.tensor([0, 0]), cache.tables, 4, 2, 0, 0.25)
