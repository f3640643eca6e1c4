"""Line charts as standalone SVG files, for the benchmarks whose results are a curve.

No plotting library: a chart is a few panels stacked over one shared x axis, each with its own
y axis and one or more series drawn as step lines (a sampled quantity holds its value until the
next sample). The SVG renders wherever the docs are read (GitHub, an editor, a browser).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

WIDTH = 760
PANEL_HEIGHT = 170
MARGIN_LEFT = 70
MARGIN_RIGHT = 150  # the legend
MARGIN_TOP = 40
GAP = 40
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    points: list[tuple[float, float]]  # (x, y), x ascending


@dataclass(frozen=True, slots=True)
class Panel:
    y_label: str
    series: list[Series]
    marks: list[tuple[float, str]] = field(default_factory=list)  # vertical lines: (x, label)


def nice_max(value: float) -> float:
    """The smallest of 1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power of ten >= ``value``."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def chart_svg(title: str, x_label: str, panels: list[Panel]) -> str:
    xs = [x for p in panels for s in p.series for x, _ in s.points]
    if not xs:
        raise ValueError("nothing to plot: every series is empty")
    x_max = nice_max(max(xs))
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    height = MARGIN_TOP + len(panels) * (PANEL_HEIGHT + GAP) + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="14">'
           f'{escape(title)}</text>']
    for i, panel in enumerate(panels):
        top = MARGIN_TOP + i * (PANEL_HEIGHT + GAP)
        out += _panel(panel, top, plot_w, x_max, x_label if i == len(panels) - 1 else "")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _panel(panel: Panel, top: float, plot_w: float, x_max: float, x_label: str) -> list[str]:
    ys = [y for s in panel.series for _, y in s.points]
    y_max = nice_max(max(ys, default=0.0))
    bottom = top + PANEL_HEIGHT

    def sx(x: float) -> float:
        return MARGIN_LEFT + plot_w * x / x_max

    def sy(y: float) -> float:
        return bottom - PANEL_HEIGHT * y / y_max

    out = [f'<rect x="{MARGIN_LEFT}" y="{top}" width="{plot_w}" height="{PANEL_HEIGHT}" '
           'fill="none" stroke="#888"/>',
           f'<text x="16" y="{top + PANEL_HEIGHT / 2}" text-anchor="middle" '
           f'transform="rotate(-90 16 {top + PANEL_HEIGHT / 2})">{escape(panel.y_label)}</text>']
    for k in range(5):
        y, x = y_max * k / 4, x_max * k / 4
        out.append(f'<text x="{MARGIN_LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">'
                   f'{_tick(y)}</text>')
        out.append(f'<text x="{sx(x):.1f}" y="{bottom + 15}" text-anchor="middle">'
                   f'{_tick(x)}</text>')
    for k, (x, label) in enumerate(panel.marks):  # labels on alternate rows: close marks
        out.append(f'<line x1="{sx(x):.1f}" y1="{top}" x2="{sx(x):.1f}" y2="{bottom}" '
                   'stroke="#aaa" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{sx(x) + 3:.1f}" y="{top + 12 + 13 * (k % 2)}" fill="#555">'
                   f'{escape(label)}</text>')
    for j, series in enumerate(panel.series):
        colour = COLOURS[j % len(COLOURS)]
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" '
                   f'points="{_steps(series.points, sx, sy)}"/>')
        legend_y = top + 14 + 16 * j
        out.append(f'<line x1="{WIDTH - MARGIN_RIGHT + 10}" y1="{legend_y - 4}" '
                   f'x2="{WIDTH - MARGIN_RIGHT + 28}" y2="{legend_y - 4}" stroke="{colour}" '
                   'stroke-width="2"/>')
        out.append(f'<text x="{WIDTH - MARGIN_RIGHT + 32}" y="{legend_y}">'
                   f'{escape(series.name)}</text>')
    if x_label:
        out.append(f'<text x="{MARGIN_LEFT + plot_w / 2}" y="{bottom + 32}" '
                   f'text-anchor="middle">{escape(x_label)}</text>')
    return out


def _steps(points: list[tuple[float, float]], sx: Callable[[float], float],
           sy: Callable[[float], float]) -> str:
    coords: list[str] = []
    for k, (x, y) in enumerate(points):
        if k:
            coords.append(f"{sx(x):.1f},{sy(points[k - 1][1]):.1f}")
        coords.append(f"{sx(x):.1f},{sy(y):.1f}")
    return " ".join(coords)


def _tick(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def write_chart(path: str | Path, title: str, x_label: str, panels: list[Panel]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(chart_svg(title, x_label, panels))
    return target
