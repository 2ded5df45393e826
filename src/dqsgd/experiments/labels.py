"""Names beside the points of a scatter plot (figure 2), placed so that they do not cover each other."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["LABEL_OFFSETS", "name_points", "overlap"]

LABEL_OFFSETS = tuple((dx, dy, ha) for dy in (4, -10, 14, -20, 24, -30, 34, -40)
                       for dx, ha in ((4, "left"), (-4, "right")))  # points, tried in this order


def name_points(ax: Axes, points: list[tuple[str, float, float]], char_pt: float = 4.2, line_pt: float = 8.0) -> None:
    """Name each point next to it, moving a name to another place (with a thin leader line) where it would
    cover an earlier name or another point: greedy, first free place in ``LABEL_OFFSETS``, else the least
    covered one; sizes are estimated from the axes' size in points at fontsize 7."""
    if not points:
        return
    ax.autoscale_view()
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    bbox = ax.get_position()
    w_pt, h_pt = bbox.width * ax.figure.get_figwidth() * 72, bbox.height * ax.figure.get_figheight() * 72
    lx0, lx1 = math.log10(x0), math.log10(x1)
    at = {m: ((math.log10(x) - lx0) / (lx1 - lx0) * w_pt, (y - y0) / (y1 - y0) * h_pt) for m, x, y in points}
    markers = {m: (px - 4, py - 4, px + 4, py + 4) for m, (px, py) in at.items()}
    taken: list[tuple[float, float, float, float]] = []
    for m, x, y in sorted(points, key=lambda p: -p[2]):
        px, py = at[m]
        others = taken + [b for k, b in markers.items() if k != m]

        def box(dx: float, dy: float, ha: str) -> tuple[float, float, float, float]:
            left = px + dx if ha == "left" else px + dx - char_pt * len(m)
            return left, py + dy, left + char_pt * len(m), py + dy + line_pt

        dx, dy, ha = min(LABEL_OFFSETS, key=lambda o: (sum(overlap(box(*o), t) for t in others), LABEL_OFFSETS.index(o)))
        taken.append(box(dx, dy, ha))
        lead = dict(arrowprops=dict(arrowstyle="-", color="0.6", lw=0.5)) if abs(dy) > 10 else {}
        ax.annotate(m, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7, ha=ha, **lead)


def overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """Area shared by two boxes (x0, y0, x1, y1); 0 when they do not meet."""
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
