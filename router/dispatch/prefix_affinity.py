"""Prefix-cache-aware replica choice: Ray Serve's request router for the model replicas.

NOTE: two views of what each replica has cached, both as the chained hashes of full blocks
(``engine.block_size`` tokens, hashed as the engine's prefix cache keys them):
- published: every replica hands Ray its cached block hashes (``record_routing_stats``, every
  ``publish_period_s``; the most recently cached ones, at most ``max_published_blocks``), and
  Ray passes them to every router. Right, including what other routers sent, but late.
- sent: this router's own index of the prompts it sent where, most recently sent first, at most
  ``index_blocks`` per replica (the oldest forgotten first, as the engine evicts its least
  recently used blocks). At once, but blind to other routers and to evictions.
A replica's match is the longer of the two. A request goes to the replica that matches most of
its leading blocks, if that is at least ``min_match_blocks`` blocks and that
replica holds no more than ``max_imbalance`` requests beyond the least loaded candidate (the
requests each replica holds: the larger of Ray's queue-length cache and this router's own count
of what it placed there and has not seen finish, ``OwnLoads``). Otherwise, and when two replicas
match equally, the less loaded is taken (ties: at random); nothing matched: the power of two
choices (the less loaded of two at random, on the same loads). A replica that cannot take the
request (full) makes Ray try the next rank: the other candidates, least loaded first. A
request that moved away from a replica (stalled, unreachable: ``ReplicaCall.avoid``) is not
ranked there again while another replica is a candidate.

A request of a LoRA adapter that no prefix matched goes, by the same rule, to a replica that
holds the adapter (it published it as loaded, or this router sent it one of its requests lately:
at most ``MAX_ADAPTERS_REMEMBERED`` per replica), unless that one is overloaded: an adapter
loaded elsewhere is a load (milliseconds to a second) saved. Its prompts' blocks are keyed in the
adapter's own partition, as the engine keys them (``adapter_salt``).

A wrong guess costs prefill time, never a wrong answer (the engine computes whatever its cache
lacks). Generated tokens are not indexed: the router only knows prompts (and the int4 engine
keys blocks holding generated tokens apart from prompt blocks anyway).
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from replicas.protocol import (
    PUBLISHED_ADAPTERS,
    PUBLISHED_BLOCKS,
    PUBLISHED_VERSION,
    ReplicaCall,
    adapter_salt,
    cache_root,
    hash_block_tokens,
)

logger = logging.getLogger(__name__)

MAX_ADAPTERS_REMEMBERED = 64  # per replica: the adapters this router sent it lately


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None
                 ) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` in the prefix-cache partition
    ``salt``: the i-th names the first i+1 blocks."""
    hashes: list[int] = []
    parent = cache_root(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


def published_match(cached: set[int] | frozenset[int], hashes: Sequence[int]) -> int:
    """How many leading blocks of the prompt are in a replica's published cached set."""
    count = 0
    for h in hashes:
        if h not in cached:
            break
        count += 1
    return count


class PrefixIndex:
    """Per replica, the block hashes of the prompts sent there; least recently sent forgotten
    first beyond ``max_blocks``."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def matched_blocks(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt ``replica`` was sent."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        count = 0
        for h in hashes:  # chained: a block matches only after all the blocks before it
            if h not in blocks:
                break
            count += 1
        return count

    def forget(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def keep_only(self, replicas: set[str]) -> None:
        for replica in [r for r in self._blocks if r not in replicas]:
            del self._blocks[replica]

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))


class OwnLoads:
    """The requests this router placed on each replica and has not seen finish.

    NOTE: Ray's queue-length cache alone left two holes. An entry expires 10 s after its last
    update (``RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S``) and is refreshed only by sends to and
    probes of that replica; a replica that affinity kept passing over lost its entry, the least
    load was then taken over the known entries only, and the favoured replica, measured
    against itself, stayed eligible up to ``max_ongoing_requests``. And Ray may ask the router
    to rank a burst's requests before it counts the first send. So this router counts what it
    places, at once: ``picked`` when it ranks a replica first, ``routed`` when Ray says where
    the request went (it may be another rank), ``completed`` when it ends; a pick never routed
    (its caller went away before the send) is forgotten after ``pick_ttl_s``. A replica's load
    is the larger of this count and Ray's entry (which also sees other routers' requests)."""

    def __init__(self, pick_ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pick_ttl_s = pick_ttl_s
        self._clock = clock
        self._picks: dict[str, tuple[str, float]] = {}  # request -> (replica, when)
        self._routed: dict[str, str] = {}  # request -> replica
        self._counts: Counter[str] = Counter()

    def picked(self, request_id: str, replica: str) -> None:
        self._drop(request_id)
        self._expire()
        self._picks[request_id] = (replica, self._clock())
        self._counts[replica] += 1

    def routed(self, request_id: str, replica: str) -> None:
        self._drop(request_id)
        self._routed[request_id] = replica
        self._counts[replica] += 1

    def completed(self, request_id: str) -> None:
        self._drop(request_id)

    def count(self, replica: str) -> int:
        return self._counts[replica]

    def forget(self, replica: str) -> None:
        for table in (self._picks, self._routed):
            for request_id in [r for r, v in table.items() if _replica_of(v) == replica]:
                del table[request_id]
        self._counts.pop(replica, None)

    def keep_only(self, replicas: set[str]) -> None:
        for replica in [r for r in self._counts if r not in replicas]:
            self.forget(replica)

    def _drop(self, request_id: str) -> None:
        pick = self._picks.pop(request_id, None)
        replica = pick[0] if pick is not None else self._routed.pop(request_id, None)
        if replica is not None:
            self._counts[replica] -= 1
            if self._counts[replica] <= 0:
                del self._counts[replica]

    def _expire(self) -> None:
        horizon = self._clock() - self.pick_ttl_s
        for request_id in [r for r, (_, at) in self._picks.items() if at < horizon]:
            self._drop(request_id)


def _replica_of(value: str | tuple[str, float]) -> str:
    return value if isinstance(value, str) else value[0]


def rank_by_affinity(matches: dict[str, int], loads: Mapping[str, int | None],
                     min_match_blocks: int, max_imbalance: int,
                     rng: random.Random) -> list[str] | None:
    """Replicas in the order to try them, or None when affinity has nothing to say (no match
    worth it): the caller falls back to its load-only choice. ``loads`` None: not known."""
    known = [load for load in loads.values() if load is not None]
    least = min(known, default=0)
    eligible = [r for r, m in matches.items() if m >= min_match_blocks
                and (loads.get(r) is None or loads[r] <= least + max_imbalance)]  # type: ignore[operator]
    if not eligible:
        return None
    best = max(matches[r] for r in eligible)

    def load_key(replica: str) -> tuple[int, float]:
        load = loads.get(replica)
        return (least if load is None else load, rng.random())

    first = min((r for r in eligible if matches[r] == best), key=load_key)
    return [first] + sorted((r for r in matches if r != first), key=load_key)


class PrefixAffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve request router: prefix-cache affinity, balanced against load (module NOTE)."""

    def initialize_state(self, block_size: int = 16, index_blocks: int = 16_384,
                         min_match_blocks: int = 1, max_imbalance: int = 8,
                         **_: Any) -> None:
        self.block_size = block_size
        self.min_match_blocks = min_match_blocks
        self.max_imbalance = max_imbalance
        self.index = PrefixIndex(index_blocks)
        self.own_loads = OwnLoads()
        self._rng = random.Random()
        # the replicas' published cached hashes as sets, rebuilt when Ray hands new stats
        self._published: dict[str, tuple[int, frozenset[int]]] = {}
        self._sent_adapters: dict[str, OrderedDict[str, None]] = {}  # replica -> adapters

    @staticmethod
    def _call(pending_request: PendingRequest | None) -> ReplicaCall | None:
        if pending_request is None or not pending_request.args:
            return None
        call = pending_request.args[0]
        return call if isinstance(call, ReplicaCall) else None

    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        call = self._call(pending_request)
        if call is None or not call.prompt_token_ids:
            return []
        adapter = call.adapter.name if call.adapter is not None else None
        return block_hashes(call.prompt_token_ids, self.block_size,
                            adapter_salt(call.cache_salt, adapter))

    def _holds(self, replica: RunningReplica, adapter: str) -> bool:
        rid = replica.replica_id.unique_id
        return (adapter in self._sent_adapters.get(rid, ())
                or adapter in (replica.routing_stats or {}).get(PUBLISHED_ADAPTERS, ()))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        hashes = self._hashes(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        call = self._call(pending_request)
        if call is not None and call.avoid:  # replicas an earlier attempt left, while others
            rest = {rid: r for rid, r in by_id.items() if rid not in call.avoid}  # can serve
            by_id = rest or by_id
        if not by_id:
            return []
        loads = {rid: max(self._queue_len(r) or 0, self.own_loads.count(rid))
                 for rid, r in by_id.items()}
        order = None
        if hashes and len(by_id) > 1:
            matches = {rid: max(self.index.matched_blocks(rid, hashes),
                                published_match(self._published_set(r), hashes))
                       for rid, r in by_id.items()}
            order = rank_by_affinity(matches, loads, self.min_match_blocks, self.max_imbalance,
                                     self._rng)
        if order is None and call is not None and call.adapter is not None and len(by_id) > 1:
            holders = {rid: int(self._holds(r, call.adapter.name)) for rid, r in by_id.items()}
            order = rank_by_affinity(holders, loads, 1, self.max_imbalance, self._rng)
        if order is None:  # power of two choices, on the same loads
            pair = list(by_id) if len(by_id) <= 2 else self._rng.sample(list(by_id), 2)
            order = sorted(pair, key=lambda rid: (loads[rid], self._rng.random()))
        if pending_request is not None:
            self.own_loads.picked(pending_request.metadata.internal_request_id, order[0])
        return [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]]

    def _published_set(self, replica: RunningReplica) -> frozenset[int]:
        stats = replica.routing_stats or {}
        version = stats.get(PUBLISHED_VERSION, -1)
        rid = replica.replica_id.unique_id
        cached = self._published.get(rid)
        if cached is None or cached[0] != version:
            cached = (version, frozenset(stats.get(PUBLISHED_BLOCKS, ())))
            self._published[rid] = cached
        return cached[1]

    def _queue_len(self, replica: RunningReplica) -> int | None:
        return self.replica_queue_len_cache.get(replica.replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self.own_loads.routed(pending_request.metadata.internal_request_id, replica_id.unique_id)
        hashes = self._hashes(pending_request)
        if hashes:
            self.index.record(replica_id.unique_id, hashes)
        call = self._call(pending_request)
        if call is not None and call.adapter is not None:
            sent = self._sent_adapters.setdefault(replica_id.unique_id, OrderedDict())
            sent[call.adapter.name] = None
            sent.move_to_end(call.adapter.name)
            while len(sent) > MAX_ADAPTERS_REMEMBERED:
                sent.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.own_loads.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.own_loads.forget(replica_id.unique_id)
        self.index.forget(replica_id.unique_id)
        self._sent_adapters.pop(replica_id.unique_id, None)
        self._published.pop(replica_id.unique_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        self.index.keep_only(live)
        self.own_loads.keep_only(live)
        self._published = {rid: v for rid, v in self._published.items() if rid in live}
        self._sent_adapters = {rid: v for rid, v in self._sent_adapters.items() if rid in live}
