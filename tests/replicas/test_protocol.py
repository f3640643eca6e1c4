"""The replica chunk's one codec: every kind of chunk comes back equal after the round trip
Ray gives it (plain sequences, tuples returned as lists), and a token chunk stays short."""

from __future__ import annotations

import json

import pytest

from replicas.protocol import ChunkTimings, ChunkUsage, ReplicaChunk

CHUNKS = [
    ReplicaChunk((1, 2), "ab", index=1),
    ReplicaChunk((), "", replica_id="r1"),  # the replica saying it has the call
    ReplicaChunk((7,), "x", logprobs=((7, -0.25, ((7, -0.25), (9, -2.0))),)),
    ReplicaChunk((3,), "c", "length", 0, None, ChunkUsage(5, 6, 7),
                 ChunkTimings(1.0, None, 2.0, 3.0, 1, 0), "r1"),
]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_a_chunk_survives_the_round_trip(chunk: ReplicaChunk) -> None:
    wire = json.loads(json.dumps(chunk.encode()))  # lists where tuples went, as msgpack does
    assert ReplicaChunk.decode(wire) == chunk


def test_a_token_chunk_is_three_plain_fields() -> None:
    assert ReplicaChunk((5,), "hi", index=2).encode() == ((5,), "hi", 2)
    assert ReplicaChunk((), "", replica_id="r").is_empty
    assert not ReplicaChunk((), "", "stop").is_empty
