"""``fairserve usage`` (cluster/usage_cli.py) against real Redis: the records requests left,
as a table, CSV and JSON, filtered by tenant and grouped; a bad time is an error line naming
the option."""

from __future__ import annotations

import csv
import io
import json

import pytest

from cluster.cli import main
from cluster.usage_cli import parse_time
from router.dispatch.response_events import end_data
from router.state.tenants import Tenant
from tests.router.factories import add_tenants, harness, make_request, run


async def _traffic(url: str) -> None:
    async with harness(url) as h:
        await add_tenants(h, Tenant(id="acme"), Tenant(id="beta"))
        for tenant, rid, model in (("acme", "a1", "m1"), ("acme", "a2", "m2"),
                                   ("beta", "b1", "m1")):
            await h.queues.admit(make_request(tenant, rid, prompt_tokens=10, max_tokens=5,
                                              model=model))
            (grant,) = (await h.queues.grant("d", 1)).grants
            await h.queues.complete(grant.lease, 10, 5, "stop", end_data("stop", 10, 5, 2))


def test_usage_prints_the_records_as_table_csv_and_json(redis_url, capsys) -> None:
    run(_traffic(redis_url))
    base = ["usage", "--redis-url", redis_url, "--since", "1h"]
    assert main([*base, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["tenant"], r["model"]) for r in rows} >= {("acme", "m1"), ("acme", "m2"),
                                                          ("beta", "m1")}
    assert main([*base, "--tenant", "acme", "--group-by", "tenant", "--format", "csv"]) == 0
    (acme,) = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert (acme["tenant"], acme["requests"], acme["prompt_tokens"], acme["cached_tokens"]) == (
        "acme", "2", "20", "4")
    assert main([*base, "--group-by", "model,day"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["model", "start", "requests"] and len(table) >= 3


@pytest.mark.parametrize("option", ["--since", "--until"])
def test_a_bad_time_is_an_error_naming_the_option(redis_url, option, capsys) -> None:
    assert main(["usage", "--redis-url", redis_url, option, "yesterday"]) == 1
    assert f"{option}: 'yesterday'" in capsys.readouterr().err


def test_times_ago_and_utc_dates() -> None:
    now = 1_800_000_000_000
    assert parse_time("90m", now, "since") == now - 90 * 60_000
    assert parse_time("7d", now, "since") == now - 7 * 86_400_000
    assert parse_time("2026-12-01", now, "since") == 1_796_083_200_000
    assert parse_time("2026-12-01T10:00+01:00", now, "since") == 1_796_083_200_000 + 9 * 3_600_000
