"""The benchmarks' SVG charts: well-formed SVG, one step line per series, axes that hold the data."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from cluster.benchmarks.plot import Panel, Series, chart_svg, nice_max, write_chart

SVG = "{http://www.w3.org/2000/svg}"


def test_nice_max_rounds_up_to_a_round_figure():
    assert [nice_max(v) for v in (0, 0.7, 1, 3, 21, 26, 240, 251, 3789, 999)] == [
        1.0, 0.8, 1, 3, 25, 30, 250, 300, 4000, 1000]


def test_a_chart_draws_each_series_as_steps_inside_its_panel(tmp_path):
    backlog = Panel("tokens", [Series("queued", [(0.0, 0.0), (1.0, 3000.0), (4.0, 0.0)])],
                    marks=[(2.0, "decided")])
    replicas = Panel("replicas", [Series("asked", [(0.0, 1.0), (2.0, 2.0)]),
                                  Series("serving", [(0.0, 1.0), (3.0, 2.0)])])
    path = write_chart(tmp_path / "img" / "chart.svg", "a <title>", "seconds", [backlog, replicas])
    root = ET.fromstring(path.read_text())
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 3
    points = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    # a step line: each new sample first moves along x at the previous value, then to its own
    assert len(points) == 2 * 3 - 1
    assert points[1][1] == points[0][1] and points[1][0] == points[2][0]
    width, height = float(root.get("width")), float(root.get("height"))
    assert all(0 <= x <= width and 0 <= y <= height for x, y in points)
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "a <title>" in texts and "decided" in texts and "serving" in texts


def test_nothing_to_plot_is_an_error():
    with pytest.raises(ValueError, match="nothing to plot"):
        chart_svg("empty", "x", [Panel("y", [Series("none", [])])])
