"""`dqsgd bench codec|compressors|network` (and `fsdp --rates`) run scripts of the checkout's benchmarks/: found here, and a
clear refusal with exit status 2 where the folder is missing (an installed wheel ships no benchmarks/)."""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import pytest

from dqsgd.cli.bench import parser as bench_cli
from dqsgd.cli.commands import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_scripts_are_found_in_this_checkout() -> None:
    assert bench_cli.BENCHMARKS == ROOT / "benchmarks"
    codec = bench_cli.load_script("bench_codec.py")
    assert codec is not None and callable(codec.bench_codec)
    assert bench_cli.load_script("bench_codec.py") is codec  # imported once
    compressors = bench_cli.load_script("bench_compressors.py")
    assert compressors is not None and callable(compressors.bench_compressors)
    assert bench_cli.load_script("no_such_bench.py") is None


@pytest.mark.parametrize("argv", [["bench", "codec"], ["bench", "compressors", "--repeats", "1"],
                                  ["bench", "network", "--workers", "2"], ["bench", "fsdp", "--rates", "100mbit"]])
def test_without_benchmarks_the_command_says_why_and_exits_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    monkeypatch.setattr(bench_cli, "BENCHMARKS", tmp_path / "benchmarks")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"dqsgd bench {argv[1]}: needs a source checkout of dqsgd" in err and str(tmp_path / "benchmarks") in err


def test_the_command_runs_the_scripts_function_with_the_parsed_options(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, argparse.Namespace] = {}
    fake = types.SimpleNamespace(bench_compressors=lambda a: seen.setdefault("args", a) and {"rows": []})
    monkeypatch.setattr(bench_cli, "load_script", lambda rel: fake if rel == "bench_compressors.py" else None)
    assert main(["bench", "compressors", "--model", "mlp", "--repeats", "1"]) == 0
    assert seen["args"].model == "mlp" and seen["args"].repeats == 1 and seen["args"].out == "runs/bench/compressors.json"
    assert main(["bench", "codec"]) == 2  # the fake checkout holds no bench_codec.py


def test_network_forwards_its_options_and_returns_the_scripts_status(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    fake = types.SimpleNamespace(main=lambda rest: seen.append(rest) or 3)
    monkeypatch.setattr(bench_cli, "load_script", lambda rel: fake if rel == "network/bench_network.py" else None)
    assert main(["bench", "network"]) == 3
    assert main(["bench", "network", "--workers", "2", "--rates", "1gbit"]) == 3
    assert main(["bench", "network", "--help"]) == 3
    assert seen == [[], ["--workers", "2", "--rates", "1gbit"], ["--help"]]


def test_fsdp_on_shaped_links_gets_the_checkouts_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    from dqsgd.cli.bench import fsdp

    seen = []
    fake = types.SimpleNamespace()
    monkeypatch.setattr(bench_cli, "load_script", lambda rel: fake if rel == "network/netns.py" else None)
    monkeypatch.setattr(fsdp, "bench_fsdp", lambda a, netns=None: seen.append((a.rates, a.repeats, netns)))
    assert main(["bench", "fsdp", "--rates", "100mbit,1gbit", "--repeats", "1"]) == 0
    assert main(["bench", "fsdp"]) == 0  # loopback: no script needed
    assert seen == [("100mbit,1gbit", 1, fake), ("", 2, None)]
