"""build_report and the figures: contents, PNG files, rebuild from the JSONL alone, robustness."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dqsgd.experiments.plots import _by_step, figure1, figure2, figure3, load_runs, moving_average, notes
from dqsgd.experiments.report import build_report, reproduce_commands

from fake_runs import STEPS, make_root, write_run, write_toml

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGS = ("fig1.png", "fig2.png", "fig3.png", "fig4.png")


def _table_lines(text: str) -> list[str]:
    """The rows of the results table (the first table whose rows start with a method label)."""
    text = text[: text.index("## Paired differences")] if "## Paired differences" in text else text
    return [ln for ln in text.splitlines() if ln.startswith("| `")]


def test_report_has_table_commands_paper_table_and_pngs(root: Path) -> None:
    out = build_report(root)
    assert out == root / "report.md"
    text = out.read_text()
    assert (root / "summary.json").exists() and (root / "summary.csv").exists()
    # The table: rows in experiment.toml order, values as written by hand in conftest.
    assert [ln.split("|")[1].strip() for ln in _table_lines(text)] == ["`sgd`", "`qsgd-4bit`", "`dqsgd`"]
    sgd, q4, dq = _table_lines(text)
    assert "| 90.50 ± 0.71 | baseline |" in sgd
    assert "| 90.35 ± 0.21 | -0.15 ± 0.49 |" in q4          # deltas +0.2 and -0.5 pt
    assert "| 87.50 ± 0.71 | -3.00 ± 1.41 |" in dq          # deltas -2.0 and -4.0 pt
    # uplink ratio, the entropy-coded one (— : these runs have no coded sizes), then total-traffic ratio:
    # fp32 up and down (2·4·d per worker) / (516 up + 4·d fp32 down)
    assert f"| {4 * 1000 / 516:.2f} | — | {2 * 4 * 1000 / (516 + 4000):.2f} | 8.00 | 4.00 |" in q4
    assert "uplink ratio, fixed-width (paper's convention)** = fp32 uplink bytes (4·d·W·steps)" in text
    assert "**uplink ratio, entropy-coded (auto)** = the same fp32 uplink bytes" in text
    assert "**total-traffic ratio** = the same over every message" in text and "paper ratio** = 32 / mean" in text
    # Reproduce: the config's own first comment line, the exact command, the rebuild.
    assert "dqsgd compare --config fake-table1   # the config file's own command" in text
    assert f"dqsgd compare --config fake-table1 --out {root}   # exactly these runs" in text
    assert f"dqsgd report {root}" in text
    # The paper's Table 1, labelled as the paper's.
    assert "the paper's numbers, not ours" in text
    assert "| DQSGD (Ours) | 0.8997 | 6.81 | 0.8793 | 7.11 | 0.6959 | 6.73 |" in text
    assert "| SignSGD | 0.8663 | 32 | 0.5191 | 32 | 0.3955 | 32 |" in text
    # Figures embedded and written as PNG files.
    for name in FIGS:
        assert f"![{name}]({name})" in text
        assert (root / name).read_bytes()[:8] == PNG_MAGIC
    # Reading of the numbers: who is within 0.5 pt, and seeds vs differences.
    assert "Within 0.5 pt of SGD (mean paired Δ, pt): `qsgd-4bit` (-0.15). Further than 0.5 pt: `dqsgd` (-3.00)." in text
    assert "from SGD) for: `qsgd-4bit`; larger for: `dqsgd` (a rough" in text
    assert "`dqsgd` sent " in text and "more uplink bytes than `qsgd-4bit`" in text
    assert "stands in for" not in text


def test_rebuilt_identically_from_jsonl_alone(root: Path) -> None:
    first = build_report(root).read_text()
    for name in ("summary.json", "summary.csv", "report.md", *FIGS):
        (root / name).unlink()
    second = build_report(root).read_text()
    assert second == first
    assert (root / "summary.json").exists()
    assert all((root / name).read_bytes()[:8] == PNG_MAGIC for name in FIGS)


def test_stand_in_note_and_methods_tags(tmp_path: Path) -> None:
    root = make_root(tmp_path / "r", dataset="fashion-mnist", stand_in_for="CIFAR-10")
    write_run(root, "adaptive", 0, final_acc=0.89, dataset="fashion-mnist", stand_in_for="CIFAR-10")
    text = build_report(root).read_text()
    assert "**Fashion-MNIST stands in for CIFAR-10 (not obtainable offline)" in text
    methods = text.split("## Methods")[1].split("## Reading")[0]
    assert "- `adaptive`: Adaptive [OC rule]: bits from the gradient RMS" in methods
    assert "- `dqsgd`: DQSGD, budgeted" in methods and "target 4.5 bits/coordinate" in methods
    # adaptive is not in experiment.toml: the exact command says so instead of pretending.
    assert "# caveat: method 'adaptive' is not in experiment.toml" in text


def test_overrides_appear_in_the_exact_command(root: Path) -> None:
    for label, seed in (("sgd", 0), ("sgd", 1), ("qsgd-4bit", 0), ("qsgd-4bit", 1), ("dqsgd", 0), ("dqsgd", 1)):
        write_run(root, label, seed, final_acc=0.9, steps=30, train_over={"steps": 30, "seeds": [0, 1]})
    runs = load_runs(root)
    exact = reproduce_commands(root, runs)[1]
    assert exact.startswith("dqsgd compare --config fake-table1 --set train.steps=30 --out ")
    only = [r for r in runs if r.method != "qsgd-4bit"]
    assert "--methods sgd,dqsgd" in reproduce_commands(root, only)[1]


def test_robust_to_single_seed_skipped_steps_and_no_eval(root: Path) -> None:
    write_run(root, "qsgd-4bit", 1, final_acc=0.905, skipped=(0, 5, 6, STEPS - 1))  # loss null, incl. first/last
    write_run(root, "dqsgd", 1, final_acc=None)                                     # no eval line yet
    write_run(root, "adaptive", 0, final_acc=0.89, steps=12)                         # one seed, short run
    (root / "sgd" / "seed1" / "metrics.jsonl").write_text("")                        # no steps at all yet
    text = build_report(root).read_text()
    rows = {ln.split("|")[1].strip(): ln for ln in _table_lines(text)}
    assert "| 2 (1 evaluated) | 88.00 |" in rows["`dqsgd`"]  # mean alone for one evaluated seed
    assert "| 1 | 89.00 |" in rows["`adaptive`"]
    assert "dqsgd/seed1: no test evaluation yet" in text
    assert "qsgd-4bit/seed1: 4 step(s) with no loss" in text
    assert "sgd/seed1: no steps recorded yet" in text
    assert "adaptive/seed0 (12 of 40)" in text
    assert "nan" not in text.lower() and "∞" not in text
    for name in FIGS:
        assert (root / name).read_bytes()[:8] == PNG_MAGIC


def test_figures_take_runs_or_root_and_return_the_path(tmp_path: Path) -> None:
    root = tmp_path / "r"
    write_run(root, "sgd", 0, final_acc=None)  # no toml, one run, never evaluated
    runs = load_runs(root)
    assert notes(runs) == ["sgd/seed0: no test evaluation yet; left out of the accuracy panels and Figure 2"]
    for draw in (figure1, figure2, figure3):
        out = tmp_path / "figs" / f"{draw.__name__}.png"
        assert draw(root if draw is figure2 else runs, out) == out
        assert out.read_bytes()[:8] == PNG_MAGIC
    assert "# no experiment.toml here" in reproduce_commands(root, runs)[0]


def test_moving_average_ignores_nan() -> None:
    v = np.array([1.0, np.nan, 3.0, np.nan, np.nan, np.nan, 5.0])
    got = moving_average(v, 3)
    want = [1.0, 1.0, 2.0, 3.0, 3.0, np.nan, 5.0]
    np.testing.assert_allclose(got, want, equal_nan=True)
    np.testing.assert_array_equal(moving_average(v, 1), v)


def test_by_step_aligns_seeds_of_different_length() -> None:
    steps = [np.arange(4), np.arange(2)]
    vals = [np.array([1.0, 2.0, 3.0, 4.0]), np.array([3.0, np.nan])]
    x, mean, std = _by_step([None, None], vals, steps)  # type: ignore[list-item]
    np.testing.assert_array_equal(x, [0, 1, 2, 3])
    np.testing.assert_allclose(mean, [2.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(std, [np.sqrt(2.0), np.nan, np.nan, np.nan], equal_nan=True)


def test_matched_ratio_reads_figure2_seed_by_seed(root: Path) -> None:
    """DQSGD vs QSGD's curve at DQSGD's own measured ratio: interpolated linearly in log ratio, paired by seed."""
    import math

    import pytest

    from dqsgd.experiments.plots import methods_of
    from dqsgd.experiments.report import matched_ratio_deltas
    from dqsgd.experiments.summary import aggregate
    from fake_runs import FINAL_ACC

    q6 = {0: 0.890, 1: 0.896}
    for seed, acc in q6.items():
        write_run(root, "qsgd-6bit", seed, final_acc=acc)
    runs = load_runs(root)
    rows = aggregate([r.summary for r in runs], order=methods_of(runs))
    ratio = {r["method"]: r["measured_ratio"] for r in rows}
    got = matched_ratio_deltas(rows, runs)["dqsgd"]
    lo, x, hi = ratio["qsgd-6bit"], ratio["dqsgd"], ratio["qsgd-4bit"]
    assert lo < x < hi and (got["lo"], got["hi"]) == ("qsgd-6bit", "qsgd-4bit")
    f = math.log(x / lo) / math.log(hi / lo)
    want = [FINAL_ACC[("dqsgd", s)] - ((1 - f) * q6[s] + f * FINAL_ACC[("qsgd-4bit", s)]) for s in (0, 1)]
    assert got["deltas"] == pytest.approx(want, abs=1e-12)
    text = build_report(root).read_text()
    assert "At matched ratio (Figure 2): `dqsgd`" in text and "below QSGD's curve" in text


def test_figure2_marks_far_off_methods_on_the_bottom_edge(root: Path, tmp_path: Path) -> None:
    """A method 10 pt below the rest (signSGD-like) must not squash the axis: it is marked, not plotted."""
    from dqsgd.experiments.plots import draw_figure2

    write_run(root, "signsgd", 0, final_acc=0.80)
    write_run(root, "signsgd", 1, final_acc=0.80)
    ax = draw_figure2(load_runs(root)).axes[0]
    assert 85.0 < ax.get_ylim()[0] < 87.0  # the others span 87-91 % (fake_runs.FINAL_ACC), signSGD is at 80 %
    assert any("signsgd: 80.00% (below the axis)" in t.get_text() for t in ax.texts)
    text = build_report(root).read_text()
    assert "| `signsgd`" in text  # still in the table


def _coded_root(root: Path, every: int, methods: tuple[str, ...] = ("sgd", "qsgd-4bit", "dqsgd")) -> Path:
    from fake_runs import FINAL_ACC

    for (label, seed), acc in FINAL_ACC.items():
        write_run(root, label, seed, final_acc=acc, coded_every=every if label in methods else 0)
    return root


def test_entropy_coded_ratio_beside_the_fixed_width_one_in_every_table(root: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """coded_every = 4: steps 0, 4, ..., 36 carry coded sizes; the ratio is over those steps only."""
    import csv

    from dqsgd.experiments.summary import format_table, write_tables
    from fake_runs import D, W, coded_of

    _coded_root(root, 4)
    measured = range(0, STEPS, 4)
    want = {m: 4 * D * W * len(measured) / sum(coded_of(m, n) for n in measured) for m in ("sgd", "qsgd-4bit", "dqsgd")}
    assert want["qsgd-4bit"] == 4 * 1000 / 266  # 2 bits per coordinate + a 16-byte header
    rows = {r["method"]: r for r in write_tables(root)}
    for m, w in want.items():
        assert rows[m]["coded_ratio"] == w
    assert rows["qsgd-4bit"]["coded_ratio"] > rows["qsgd-4bit"]["measured_ratio"]
    with open(root / "summary.csv") as f:
        csv_rows = {r["method"]: r for r in csv.DictReader(f)}
    assert float(csv_rows["dqsgd"]["coded_ratio"]) == want["dqsgd"]
    table = format_table(list(rows.values()))
    assert "uplink fixed-width" in table and "uplink coded (auto)" in table
    assert f"{want['qsgd-4bit']:.2f}" in next(ln for ln in table.splitlines() if ln.startswith("qsgd-4bit"))
    text = build_report(root).read_text()
    q4 = next(ln for ln in _table_lines(text) if ln.startswith("| `qsgd-4bit`"))
    assert f"| {4 * 1000 / 516:.2f} | {want['qsgd-4bit']:.2f} | {2 * 4 * 1000 / (516 + 4000):.2f} |" in q4
    assert "| uplink ratio, fixed-width (paper's convention) | uplink ratio, entropy-coded (auto) |" in text
    assert "measured on every k-th step only (steps n with n % k == 0, `train.coded_every` = k = 4)" in text


def test_report_with_coded_sizes_on_every_step_and_for_some_methods_only(root: Path) -> None:
    from dqsgd.experiments.summary import format_table, write_tables

    _coded_root(root, 1, methods=("qsgd-4bit",))
    rows = {r["method"]: r for r in write_tables(root)}
    assert rows["qsgd-4bit"]["coded_ratio"] == 4 * 1000 / 266  # every step: 2 bits fewer than 4
    text = build_report(root).read_text()
    assert "measured on every step and over those steps" in text
    sgd = next(ln for ln in _table_lines(text) if ln.startswith("| `sgd`"))
    assert f"| {4 * 1000 / 4016:.2f} | — |" in sgd  # no coded sizes for sgd: a dash, not a crash
    assert next(ln for ln in format_table(list(rows.values())).splitlines() if ln.startswith("sgd")).count("—") == 1
    with open(root / "summary.csv") as f:
        assert ",," in next(ln for ln in f if ln.startswith("sgd,"))  # an empty cell, not "nan"


def test_figure2_has_a_second_panel_on_the_coded_ratio(root: Path) -> None:
    from dqsgd.experiments.plots import draw_figure2

    a, b = draw_figure2(load_runs(root)).axes  # no coded sizes: panel (b) says so
    assert a.get_title() == "(a) as sent (fixed-width)" and b.get_title() == "(b) entropy-coded (auto)"
    assert [t.get_text() for t in b.texts][0].startswith("no entropy-coded sizes recorded")
    _coded_root(root, 2)
    a, b = draw_figure2(load_runs(root)).axes
    xs = {ax: sorted(float(line.get_xdata()[0]) for line in ax.get_lines() if line.get_marker() == "o") for ax in (a, b)}
    from fake_runs import D, W, coded_of

    q4 = 4 * D * W * 20 / sum(coded_of("qsgd-4bit", n) for n in range(0, STEPS, 2))
    assert any(abs(x - q4) < 1e-9 for x in xs[b]) and not any(abs(x - q4) < 1e-9 for x in xs[a])
    assert {t.get_text() for t in b.texts} >= {"sgd", "qsgd-4bit", "dqsgd"}  # the same methods, named


def test_intervals_section_marks_what_five_seeds_separate(tmp_path: Path) -> None:
    """Five seeds: qsgd-4bit is 1 pt below SGD on every seed ± 0.1 (significant); dqsgd is +0.5 or −0.5
    alternately (not). The section prints each interval and says so in words."""
    import statistics

    from dqsgd.experiments.stats import t975

    root = tmp_path / "five"
    sgd = [0.90, 0.91, 0.89, 0.905, 0.895]
    q4 = [a - 0.01 + (0.001 if s % 2 else -0.001) for s, a in enumerate(sgd)]
    dq = [a + (0.005 if s % 2 else -0.005) for s, a in enumerate(sgd)]
    for s in range(5):
        write_run(root, "sgd", s, final_acc=sgd[s])
        write_run(root, "qsgd-4bit", s, final_acc=q4[s])
        write_run(root, "dqsgd", s, final_acc=dq[s])
    text = build_report(root).read_text()
    section = text[text.index("## Paired differences with 95% intervals"):]
    d = [100 * (a - b) for a, b in zip(q4, sgd)]
    half = t975(4) * statistics.stdev(d) / 5 ** 0.5
    m = statistics.fmean(d)
    assert f"| `qsgd-4bit` | 5 | **{m:+.2f} [{m - half:+.2f}, {m + half:+.2f}]** |" in section
    assert "significantly **less accurate**: `qsgd-4bit` vs SGD" in section.replace("Significantly", "significantly")
    assert "Not distinguishable from the reference with these seeds: `dqsgd` vs SGD" in section
    assert "| `sgd` |" not in section  # the reference has no row


def test_reproduce_commands_one_per_seed_list(root: Path) -> None:
    """Methods run with different seed lists get one exact command each, the later ones with --resume."""
    from dqsgd.experiments.plots import load_runs
    from dqsgd.experiments.report import reproduce_commands

    write_run(root, "sgd", 2, final_acc=0.905)
    lines = [ln for ln in reproduce_commands(root, load_runs(root)) if "exactly these runs" in ln]
    assert len(lines) == 2, lines
    assert "--methods sgd" in lines[0] and "(1 of 2: seed lists differ)" in lines[0] and "--resume" not in lines[0]
    assert "--methods qsgd-4bit,dqsgd" in lines[1] and lines[1].split("   #")[0].endswith("--resume")


def test_a_methods_own_train_keys_stay_the_methods_in_the_exact_command(tmp_path: Path) -> None:
    """A method table's own [train] key (here downlink_bits = 32 for sgd) is that method's: the exact
    command must not turn it into a global --set train.downlink_bits that would change the other methods'
    runs; a run whose own value differs from its table's gets a --set methods.M.KEY of its own."""
    from fake_runs import TOML
    from dqsgd.experiments.plots import load_runs

    root = tmp_path / "r"
    root.mkdir()
    toml = TOML.format(dataset="mnist", W=4, STEPS=STEPS, EVAL_EVERY=10).replace(
        "[methods.sgd]\n", "[methods.sgd]\ndownlink_bits = 32\n")
    (root / "experiment.toml").write_text(toml)
    for label in ("sgd", "qsgd-4bit", "dqsgd"):
        for seed in (0, 1):
            write_run(root, label, seed, final_acc=0.9, train_over={"downlink_bits": 32} if label == "sgd" else None)
    exact = [ln for ln in reproduce_commands(root, load_runs(root)) if "exactly these runs" in ln]
    assert exact == [f"dqsgd compare --config fake-table1 --out {root}   # exactly these runs"]
    write_run(root, "sgd", 1, final_acc=0.9, train_over={"downlink_bits": 16})  # seed 1 ran otherwise
    write_run(root, "sgd", 0, final_acc=0.9, train_over={"downlink_bits": 16})
    exact = [ln for ln in reproduce_commands(root, load_runs(root)) if "exactly these runs" in ln]
    assert exact == [f"dqsgd compare --config fake-table1 --set methods.sgd.downlink_bits=16 --out {root}"
                     "   # exactly these runs"], exact


def test_methods_section_tells_the_topology_and_the_downlink_apart(tmp_path: Path) -> None:
    """Two rows that differ only in the sharded downlink (fixed 8 bits, or "auto" with the both-leg
    budget the ledger charged) must not read the same in the Methods section; ps rows say nothing more."""
    import json

    from fake_runs import D

    root = make_root(tmp_path / "r")
    for label, down in (("dqsgd-down8", 8), ("dqsgd-auto", "auto"), ("dqsgd-default", 0), ("dqsgd-fp32", 32)):
        for seed in (0, 1):
            made = write_run(tmp_path / label, "dqsgd", seed, final_acc=0.9,
                             train_over={"topology": "sharded", "downlink_bits": down})
            run = made.rename(root / label / f"seed{seed}") if (root / label).mkdir(exist_ok=True) is None else made
            facts = json.loads((run / "config.json").read_text())
            facts.update(method=label, budget_bits=12 * D * STEPS if down == "auto" else None)
            (run / "config.json").write_text(json.dumps(facts))
    methods = build_report(root).read_text().split("## Methods")[1].split("## Reading")[0]
    line = {ln.split("`")[1]: ln for ln in methods.splitlines() if ln.startswith("- `")}
    assert line["dqsgd-down8"].endswith("target 4.5 bits/coordinate, topology sharded, downlink 8 bits.")
    assert line["dqsgd-auto"].endswith(
        "target 4.5 bits/coordinate, topology sharded, downlink auto (one budget for both legs: 12.00 bits/coordinate/step).")
    assert line["dqsgd-default"].endswith("topology sharded, downlink the method's default.")
    assert line["dqsgd-fp32"].endswith("topology sharded, downlink fp32.")
    assert "topology" not in line["dqsgd"] and "downlink" not in line["qsgd-4bit"]
    fed = tmp_path / "fed"  # train.downlink_feedback is the table's, not a method's: a table of its own
    write_toml(fed)
    for seed in (0, 1):
        write_run(fed, "dqsgd", seed, final_acc=0.9,
                  train_over={"topology": "sharded", "downlink_bits": 2, "downlink_feedback": True})
    assert "topology sharded, downlink 2 bits, downlink error feedback." in build_report(fed).read_text()


def _evaluated_at(root: Path, steps: set[int]) -> Path:
    """sgd and qsgd-4bit (seed 0) with a test accuracy on ``steps`` only."""
    import json

    write_toml(root)
    for label in ("sgd", "qsgd-4bit"):
        run = write_run(root, label, 0, final_acc=0.9)
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for r in recs:
            r.pop("test_acc", None)
            if r["step"] in steps:
                r.update(test_acc=0.8 + 0.001 * r["step"], test_loss=0.3)
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return root


def test_figure1_shows_few_evaluations_as_points_and_says_where(tmp_path: Path) -> None:
    """Two evaluations per run (make run's steps=250, eval_every=125): panel (a) names the evaluated steps,
    draws large markers on a faint dotted line (not a measured trajectory); with many it draws curves."""
    from dqsgd.experiments.plots import FIG1_FEW_EVALS, draw_figure1

    a = draw_figure1(load_runs(_evaluated_at(tmp_path / "few", {19, 39}))).axes[0]
    assert "2 evaluations (step 19, 39), nothing measured between them" in a.get_title()
    acc = [ln for ln in a.get_lines() if ln.get_marker() == "o"]
    assert len(acc) == 2 and all(ln.get_linestyle() == ":" and ln.get_markersize() >= 6 for ln in acc)
    assert all(list(ln.get_xdata()) == [19, 39] for ln in acc)
    many = set(range(4, 40, 5))
    assert len(many) >= FIG1_FEW_EVALS
    a = draw_figure1(load_runs(_evaluated_at(tmp_path / "many", many))).axes[0]
    assert a.get_title() == "(a) test accuracy"
    assert all(ln.get_linestyle() != ":" for ln in a.get_lines() if ln.get_marker() == "o")


def test_figure2_joins_only_the_points_of_one_family(tmp_path: Path) -> None:
    """dqsgd and dqsgd-coded are two families: no line may join them; QSGD's widths are one family."""
    from dqsgd.experiments.plots import draw_figure2, families

    root = tmp_path / "fam"
    write_toml(root)
    for label, acc in (("sgd", 0.90), ("qsgd-4bit", 0.89), ("qsgd-6bit", 0.90), ("dqsgd", 0.895),
                       ("dqsgd-coded", 0.885), ("adaptive", 0.89)):
        write_run(root, label, 0, final_acc=acc)
    runs = load_runs(root)
    fam = families(runs)
    assert sorted(fam.values()) == sorted([["sgd"], ["qsgd-4bit", "qsgd-6bit"], ["dqsgd"], ["dqsgd-coded"],
                                           ["adaptive"]])
    a = draw_figure2(runs).axes[0]
    joined = [ln for ln in a.get_lines() if ln.get_label().endswith("connected")]
    assert [ln.get_label() for ln in joined] == ["QSGD widths, connected"]
    assert len(joined[0].get_xdata()) == 2


def test_in_words_says_one_seed_cannot_tell(root: Path, tmp_path: Path) -> None:
    """One seed: no interval, so the words must not say "none" was significant or indistinguishable."""
    one = tmp_path / "one"
    write_toml(one)
    for label, acc in (("sgd", 0.90), ("qsgd-4bit", 0.85), ("dqsgd", 0.95)):
        write_run(one, label, 0, final_acc=acc)
    text = build_report(one).read_text()
    words = text[text.index("In words:"):].splitlines()[0]
    assert "one seed cannot tell" in words and "`qsgd-4bit` vs SGD" in words and "`dqsgd` vs SGD" in words
    assert "none" not in words and "significantly" not in words
    two = build_report(root).read_text()  # two seeds: the verdicts, and nothing about one seed
    words = two[two.index("In words:"):].splitlines()[0]
    assert "Not distinguishable from the reference with these seeds" in words and "one seed" not in words
