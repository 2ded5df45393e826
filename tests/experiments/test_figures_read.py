"""The figures read as a reader needs: what is not drawn is said plainly, integer widths get integer
ticks, one legend for Figure 1, the ratio axis in plain numbers, names that do not cover each other."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

from fake_runs import write_run

from dqsgd.experiments.plots import draw_figure1, draw_figure2, draw_figure3, load_runs


def test_figure1_says_what_panel_c_leaves_out_and_has_one_legend(root: Path) -> None:
    fig = draw_figure1(load_runs(root))
    a, b, c, d = fig.axes
    assert c.get_title().startswith("(c) bits per iteration") and "not shown" not in c.get_title()
    notes = [t.get_text() for t in c.texts]
    assert notes == ["not drawn (32-bit floats, no quantization): sgd"]
    assert all(ax.get_legend() is None for ax in (a, b, c, d)) and len(fig.legends) == 1
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["sgd (2 seeds)", "qsgd-4bit (2 seeds)",
                                                                  "dqsgd (2 seeds)"]


def test_figure3_ticks_are_the_integer_widths_chosen(root: Path) -> None:
    a = draw_figure3(load_runs(root)).axes[0]
    assert list(a.get_xticks()) == [4, 5]  # fake dqsgd alternates 4 and 5 bits; no 3.75 or 4.25


def test_figure2_ratio_ticks_are_plain_and_names_do_not_overlap(root: Path) -> None:
    for label in ("qsgd-5bit", "qsgd-6bit", "qsgd-3bit"):  # crowd the points near qsgd-4bit's 90.35 %
        for seed in (0, 1):
            write_run(root, label, seed, final_acc=0.9035 + 0.0005 * seed)
    fig = draw_figure2(load_runs(root))
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels and all(t.replace(".", "").isdigit() for t in labels), labels
    fig.canvas.draw()
    boxes = {t.get_text(): t.get_window_extent() for t in ax.texts}
    assert {"qsgd-3bit", "qsgd-4bit", "qsgd-5bit", "qsgd-6bit", "sgd"} <= set(boxes)
    hits = [(m, n) for (m, p), (n, q) in combinations(boxes.items(), 2) if p.overlaps(q)]
    assert hits == []
