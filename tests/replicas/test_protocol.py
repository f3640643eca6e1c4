"""The replica report's one codec: every kind of report comes back equal after the round trip
Ray gives it (plain sequences, tuples returned as lists), and says what it is."""

from __future__ import annotations

import json

import pytest

from replicas.protocol import CallReport, ChunkTimings, ChunkUsage, Halt

REPORTS = [
    CallReport("r1"),  # the replica saying it has the call
    CallReport(),  # alive
    CallReport("r1", 2, "length", 9, ChunkUsage(5, 6, 7),
               ChunkTimings(1.0, 1.5, 2.0, 3.0, 2, 1)),
    CallReport("r1", 0, "stop", 3, None, ChunkTimings(1.0, None, None, 3.0)),
    CallReport(halted=Halt.LEASE_LOST),
]


@pytest.mark.parametrize("report", REPORTS)
def test_a_report_survives_the_round_trip(report: CallReport) -> None:
    wire = json.loads(json.dumps(report.encode()))  # tuples come back as lists, as over Ray
    assert CallReport.decode(wire) == report


def test_a_report_says_what_it_is() -> None:
    assert CallReport().is_heartbeat
    assert not CallReport("r1").is_heartbeat
    assert not CallReport(None, 0, "stop", 1).is_heartbeat
    assert not CallReport(halted=Halt.CANCELLED).is_heartbeat
