"""benchmarks/network/bench_network.py without root: its method names, option checks, the table's
medians and speed-ups, and its refusal to overwrite a finished run (the shaped runs themselves need root
and minutes, so they are run by hand; see the script's docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dqsgd.cli.bench import parser as bench_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "network"))  # the script imports its netns helper
    module = bench_cli.load_script("network/bench_network.py")
    assert module is not None
    return module


def test_method_names_map_to_engine_and_topology(bench: Any) -> None:
    assert bench.variant("qsgd-4bit") == ("qsgd-4bit", "hook", "sharded")
    assert bench.variant("dqsgd-allgather") == ("dqsgd", "hook", "allgather")
    assert bench.variant("dqsgd-trainer") == ("dqsgd", "trainer", "sharded")
    assert [bench.variant(m) for m in ("fp32", "fp16", "powersgd", "dqsgd-bogus")] == [None] * 4
    assert all(bench.method_problem(m) == "" for m in bench.DEFAULT_METHODS)


def test_any_registered_method_with_a_topology_and_a_downlink_width_is_a_row(bench: Any) -> None:
    from dqsgd.method.config import METHODS

    for name in METHODS:
        assert bench.variant(name) == (name, "hook", "sharded"), name
        assert bench.variant(name + "-trainer") == (name, "trainer", "sharded"), name
    assert bench.variant("qsgd-2bit@4") == ("qsgd-2bit", "hook", "sharded")
    assert bench.variant("dqsgd-coded-allgather") == ("dqsgd-coded", "hook", "allgather")
    assert [bench.powersgd_rank(m) for m in ("powersgd", "powersgd-r2", "powersgd-r4", "powersgd-r0", "fp16")] \
        == [1, 2, 4, None, None]
    assert bench.method_problem("qsgd-2bit@4") == "" and bench.method_problem("qsgd-2bit@fp32") == ""
    assert "@DOWN needs the sharded topology" in bench.method_problem("qsgd-2bit-allgather@4")
    assert "@DOWN needs" in bench.method_problem("qsgd-2bit@1")
    a = bench.parse(["--downlink-bits", "8"])
    a.method = "qsgd-2bit@4"
    assert bench.downlink(a) == 4
    a.method = "qsgd-2bit"
    assert bench.downlink(a) == 8
    assert bench.downlink_options(a) == {"downlink_feedback": False, "allow_unsafe_downlink": True}
    a.method = "qsgd-2bit@2e"  # error-fed
    assert bench.method_problem(a.method) == "" and bench.downlink(a) == 2
    assert bench.downlink_options(a)["downlink_feedback"]
    assert "@DOWN needs" in bench.method_problem("qsgd-2bit@1e") and "@DOWN needs" in bench.method_problem("qsgd-2bit@e")


@pytest.mark.parametrize(("argv", "problem"), [
    (["--methods", "fp32,nope"], "unknown method 'nope'"),
    (["--methods", "qsgd-4bit-allgather@4"], "@DOWN needs the sharded topology"),
    (["--workers", "1"], "--workers must be >= 2"),
    (["--hidden", "512,x"], "--hidden must be comma-separated positive widths"),
    (["--hidden", "512", "--model", "cnn"], "--hidden applies to --model mlp"),
    (["--hidden", "512", "--methods", "fp32,dqsgd-trainer"], "--hidden applies to --model mlp"),
    (["--downlink-bits", "17"], "--downlink-bits must be 2..16, fp32 or auto"),
    (["--methods", "qsgd-2bit@auto"], "needs a budgeted policy"),
    (["--methods", "sketched-sgd"], "which the DDP hook does not run; use sketched-sgd-trainer"),
    (["--methods", "sgd-backup4"], "backup workers must be in [1, W - 1] = [1, 3]"),
    (["--methods", "ef-signsgd-backup1"], "backup workers need a method whose workers send one independent"),
    (["--hidden", "512", "--methods", "fp32,sgd-backup1"], "--hidden applies to --model mlp"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_options_exit_2_with_the_reason(bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            argv: list[str], problem: str) -> None:
    assert bench.main([*argv, "--out", str(tmp_path)]) == 2
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "network.json").exists()


def test_a_finished_run_is_not_overwritten(bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "network.json").write_text("{}")
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err and (tmp_path / "network.json").read_text() == "{}"


def _row(method: str, seconds: float | None, rep: int = 0) -> dict[str, Any]:
    return {"rate": "100mbit", "method": method, "repeat": rep, "steps": 100, "final_acc": 0.9, "train_s": 9.0,
            "reached": None if seconds is None else {"step": 90, "train_s": seconds},
            "wire_bytes": 4_000_000, "wire_bytes_per_rank": [1_250_000, 1_000_000], "payload_ratio": None}


def test_table_gives_median_over_repeats_and_speedups_against_fp32_and_fp16(bench: Any) -> None:
    rows = [_row("fp32", 12.0, 0), _row("fp16", 6.0, 0), _row("dqsgd", 3.0, 0), _row("qsgd-4bit", None, 0),
            _row("fp32", 10.0, 1), _row("fp16", 6.0, 1), _row("dqsgd", 5.0, 1), _row("qsgd-4bit", 2.0, 1),
            _row("fp32", 11.0, 2), _row("fp16", 6.0, 2), _row("dqsgd", 4.0, 2), _row("qsgd-4bit", 2.0, 2)]
    lines = {line.split()[1]: line for line in bench.table(rows, 0.9).splitlines()[2:]}
    assert "11.0 s [10.0-12.0]" in lines["fp32"] and "1.00x   0.55x" in lines["fp32"]
    assert "4.0 s [3.0-5.0]" in lines["dqsgd"] and "2.75x   1.50x" in lines["dqsgd"]
    assert lines["qsgd-4bit"].split()[2:5] == ["—", "—", "—"]  # one repeat missed the target: no median
    assert " 0.1 " in lines["fp32"]  # link s: the busiest rank's 1.25 MB at 100 Mbit/s


def test_summary_tables_several_runs_with_their_commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import json

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "network"))
    summarize = bench_cli.load_script("network/summarize.py")
    assert summarize is not None
    config = {"workers": 4, "model": "mlp", "hidden": "", "target": 0.9}
    run = tmp_path / "w4"
    run.mkdir()
    (run / "network.json").write_text(json.dumps({"command": "sudo bench --workers 4", "config": config,
                                                  "runs": [_row("fp32", 12.0), _row("dqsgd", 3.0)]}))
    assert summarize.main([str(run), "--out", str(tmp_path / "sum")]) == 0
    md = (tmp_path / "sum" / "summary.md").read_text()
    assert "| `w4`: W = 4, mlp, target 90% | 100mbit | DQSGD sharded | 3.0 | 4.00x | — | 100 | 0.013 |" in md
    assert "`sudo bench --workers 4`" in md and (tmp_path / "sum" / "summary.png").stat().st_size > 0
    assert summarize.main([str(run), "--readme", "2-core test machine; load 0.5"]) == 0
    readme = (run / "README.md").read_text()
    assert "2-core test machine; load 0.5" in readme and "    sudo bench --workers 4" in readme
    # fp32 sends 4 MB in 100 steps: 0.040 MB/step, the same as dqsgd here (ratio 1.0); 12 s / 3 s = 4x
    assert "| 100mbit | `dqsgd` (DQSGD sharded) | 3.0 | 4.00x | 0.040 | 1.0 | 90 | 0.9000 | 100 |" in readme
    assert summarize.label("dqsgd-coded@auto") == "dqsgd-coded, both-leg budget"
    assert summarize.label("dqsgd@autoe") == "DQSGD sharded, both-leg budget, error-fed"
    assert summarize.label("qsgd-2bit@4") == "qsgd-2bit, downlink 4 bits" and summarize.label("powersgd-r4") == \
        "PowerSGD rank 4"
    assert summarize.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "no network.json" in capsys.readouterr().err


def test_a_failed_run_is_reported_and_has_no_time(bench: Any) -> None:
    rows = [_row("fp32", 12.0), {"rate": "100mbit", "method": "powersgd", "repeat": 0,
                                 "error": "powersgd: ranks ended with [None, None] (None: still running at the deadline)"}]
    lines = bench.table(rows, 0.9).splitlines()
    assert "failed: powersgd: ranks ended with [None, None]" in lines[-1]
    assert bench.time_to_target(rows[1:]) is None and bench.speedup(bench.grouped(rows), "100mbit", "fp32", "powersgd") == "—"


def test_auto_downlink_rows_are_the_budgeted_methods_defaults(bench: Any) -> None:
    from dqsgd.ddp import HookState

    a = bench.parse([])  # --downlink-bits 8: a bare row keeps the committed tables' 8-bit downlink
    for row, width in [("dqsgd@auto", "auto"), ("dqsgd-coded@auto", "auto"), ("dqsgd", 8), ("dqsgd@autoe", "auto")]:
        a.method = row
        assert bench.method_problem(row) == "" and bench.downlink(a) == width, row
    a.method = "dqsgd@auto"  # exactly what users get from HookState("dqsgd"): no flag of its own
    assert bench.downlink_options(a) == {"downlink_feedback": False, "allow_unsafe_downlink": False}
    state = HookState("dqsgd", downlink_bits=bench.downlink(a), **bench.downlink_options(a))
    assert state.fields() == HookState("dqsgd").fields() and state.downlink_bits == "auto"
    a.method = "dqsgd@autoe"
    assert bench.downlink_options(a) == {"downlink_feedback": True, "allow_unsafe_downlink": False}
    a = bench.parse(["--downlink-bits", "auto"])  # every row's method default: None, as HookState takes it
    for row in ("dqsgd", "qsgd-2bit", "dqsgd-trainer"):
        a.method = row
        assert bench.downlink(a) is None, row
    assert HookState("qsgd-2bit", downlink_bits=None).downlink_bits == 8
    assert bench.check_args(a, ["dqsgd", "qsgd-2bit", "fp32"]) == ""
    assert "@DOWN needs" in bench.method_problem("dqsgd-allgather@auto")
    assert "@DOWN needs" in bench.method_problem("dqsgd@fp32e") and "@DOWN needs" in bench.method_problem("dqsgd@autox")


def test_sketch_and_backup_rows_run_on_the_trainer(bench: Any) -> None:
    assert bench.variant("sketched-sgd-trainer") == ("sketched-sgd", "trainer", "sharded")
    assert bench.variant("sketched-sgd-ps") == ("sketched-sgd", "trainer", "ps")
    assert bench.method_problem("sketched-sgd-trainer") == "" and bench.method_problem("sketched-sgd-ps") == ""
    assert "does not run" in bench.method_problem("sketched-sgd-allgather")
    assert bench.variant("sgd-backup1") == ("sgd", "trainer", "ps") and bench.backup_workers("sgd-backup1") == 1
    assert bench.variant("qsgd-4bit-backup2") == ("qsgd-4bit", "trainer", "ps")
    assert bench.backup_workers("qsgd-4bit-backup2") == 2 and bench.backup_workers("qsgd-4bit") == 0
    assert bench.method_problem("qsgd-4bit-backup2", 4) == "" and bench.method_problem("sgd-ps") == ""
    for bad in ("fp32-backup1", "backup1", "sgd-backup", "nope-backup1", "sgd-backup0", "sgd-backup1x"):
        assert bench.variant(bad) is None, bad
    assert "@DOWN needs" in bench.method_problem("sgd-backup1@4", 4)
    assert "sketch rounds" in bench.method_problem("sketched-sgd-backup1", 4)


def test_local_sgd_rows_parse_and_bad_ones_are_refused(bench: Any) -> None:
    assert bench.local_row("local-h16") == ("local", 16, {"method": "sgd"})  # fp32 pseudo-gradients
    assert bench.local_row("local-h8-qsgd-4bit") == ("local", 8, {"method": "qsgd-4bit"})
    assert bench.local_row("local-h4-dqsgd-coded") == ("local", 4, {"method": "dqsgd-coded"})
    assert bench.local_row("postlocal-h16") == ("postlocal", 16, None)
    for name in ("local-h0", "local-hx", "postlocal-h8-qsgd-4bit", "qsgd-4bit", "fp32"):
        assert bench.local_row(name) is None, name
    assert all(bench.method_problem(m) == "" for m in ("local-h16", "local-h8-qsgd-4bit", "postlocal-h4"))
    assert "is not a dqsgd method" in bench.method_problem("local-h8-bogus")
    assert "a Local SGD row is" in bench.method_problem("postlocal-h8-qsgd-4bit")
    assert bench.check_args(bench.parse(["--methods", "local-h8"]), ["local-h8", "postlocal-h0"]).startswith(
        "'postlocal-h0': a Local SGD row is")



DILOCO = "local-fashion-1500:diloco-h32-lr1-m05-dqsgd-coded-ef3"


def test_a_config_row_runs_its_method_table_through_the_trainers_loader(bench: Any) -> None:
    """``CONFIG:LABEL``: DiLoCo's outer Nesterov, the budgeted coded method capped at 4 bits and the 3-bit
    error-fed downlink as the config's table sets them; ``+KEY=VALUE`` overrides its keys (H, streaming)."""
    kind, h, opts = bench.local_row(DILOCO)
    config = opts.pop("method")
    assert (kind, h) == ("local", 32) and (config.name, config.target_bits, config.max_bits) == ("dqsgd-coded", 0.8, 4)
    assert opts == {"outer": "nesterov", "outer_lr": 1.0, "outer_momentum": 0.5, "topology": "sharded",
                    "downlink_bits": 3, "downlink_coding": config.coding, "downlink_feedback": True,
                    "fragments": 1, "overlap": 0}
    kind, h, opts = bench.local_row(DILOCO + "+local_steps=16+fragments=3+overlap_steps=4+target_bits=1.5")
    assert (h, opts["fragments"], opts["overlap"], opts["method"].target_bits) == (16, 3, 4, 1.5)
    assert bench.method_problem(DILOCO) == "" and bench.method_problem("local-fashion:sgd") == ""
    assert bench.local_row("local-fashion:local-h16-qsgd4")[:2] == ("local", 16)


def test_a_local_rows_warmup_covers_its_first_exchange(bench: Any) -> None:
    """So that the first exchange's one-time costs (the coders' compilation: about a minute on 8 processes sharing
    2 cores) fall outside the timed steps; a DDP row exchanges at every warm-up step already."""
    assert bench.warmup_steps("local-h16-dqsgd-coded", 2) == 16 and bench.warmup_steps("postlocal-h8", 2) == 8
    assert bench.warmup_steps(DILOCO + "+local_steps=16+fragments=4+overlap_steps=3", 2) == 19
    assert bench.warmup_steps("local-h4", 10) == 10 and bench.warmup_steps("local-h4", 0) == 0
    assert bench.warmup_steps("fp32", 2) == bench.warmup_steps("dqsgd-coded@auto", 2) == 2


def test_bad_config_rows_are_refused_naming_the_fault(bench: Any) -> None:
    assert "not in the config" in bench.method_problem("local-fashion-1500:bogus")
    assert "unknown" in bench.method_problem(DILOCO + "+bogus_key=1")
    assert "fragments" in bench.method_problem(DILOCO + "+local_steps=2+fragments=4")  # F > H
    assert "inner_optimizer" in bench.method_problem(DILOCO + "+inner_optimizer=\"adamw\"")
    assert "no-such-config" in bench.method_problem("no-such-config:sgd")
    assert bench.check_args(bench.parse([]), ["fp32", "local-fashion-1500:bogus"]).startswith(
        "'local-fashion-1500:bogus': ")


def test_the_peak_step_is_the_most_bytes_rank_0_sent_in_one_step(bench: Any) -> None:
    row = {**_row("local-h4", 3.0), "trace": [[0.1, 10], [0.2, 20], [0.9, 520], [1.0, 530]]}
    assert bench.peak_step(row) == (500, pytest.approx(0.7))
    assert bench.peak_step(_row("fp32", 1.0)) is None  # recorded before the trace existed
    line = bench.table([row], 0.9).splitlines()[2]
    assert line.split()[-1] == "0.001"


def test_coded_rows_and_a_rows_own_downlink_target(bench: Any) -> None:
    """``qsgd-<B>bit-<coding>`` rows, and ``@auto[e]:D``: the split's downlink_target_bits for that row alone
    (``--downlink-target-bits`` for the other auto rows); refused off an auto downlink or out of range."""
    from dqsgd.ddp import HookState

    assert bench.variant("qsgd-2bit-auto@4") == ("qsgd-2bit-auto", "hook", "sharded")
    assert bench.method_problem("qsgd-2bit-auto@4") == ""
    a = bench.parse(["--downlink-target-bits", "2"])
    a.method = "dqsgd-coded@autoe:1"
    assert bench.method_problem(a.method) == "" and bench.downlink(a) == "auto"
    opts = bench.downlink_options(a)
    assert opts == {"downlink_feedback": True, "allow_unsafe_downlink": False, "downlink_target_bits": 1.0}
    assert HookState("dqsgd-coded", downlink_bits="auto", **opts).downlink.target_bits == 1.0
    a.method = "dqsgd@auto"  # the flag's value
    assert bench.downlink_options(a)["downlink_target_bits"] == 2.0
    a.method = "qsgd-2bit@4"  # not a budgeted split: no target
    assert "downlink_target_bits" not in bench.downlink_options(a)
    for bad in ("dqsgd@4:1", "dqsgd@auto:0", "dqsgd@auto:x", "dqsgd@autoe:17"):
        assert "':TARGET' follows @auto" in bench.method_problem(bad), bad


def test_a_bare_link_row_chooses_its_downlink_as_the_hook_does(bench: Any) -> None:
    """``dqsgd-link`` is not pinned at ``--downlink-bits`` (8): it runs HookState("dqsgd-link")'s default,
    the downlink its policy chooses each step among 4..max_bits; ``dqsgd-link@8`` pins it."""
    from dqsgd.ddp import HookState

    a = bench.parse([])
    a.method = "dqsgd-link"
    assert bench.method_problem(a.method) == "" and bench.downlink(a) is None
    assert bench.downlink_options(a) == {"downlink_feedback": False, "allow_unsafe_downlink": False}
    state = HookState("dqsgd-link", downlink_bits=bench.downlink(a), **bench.downlink_options(a))
    assert state.fields() == HookState("dqsgd-link").fields() and state.downlink_bits == "auto"
    a.method = "dqsgd-link@8"
    assert bench.downlink(a) == 8
    a.method = "dqsgd-link-allgather"  # no downlink width to choose
    assert bench.downlink(a) == 8
