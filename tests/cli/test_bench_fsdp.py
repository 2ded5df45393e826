"""The tables of `dqsgd bench fsdp` (loopback and shaped links), from given per-rank figures."""

from __future__ import annotations

from dqsgd.cli.bench.fsdp import shaped_table, table


def _rank(fp32_ms: float, q_ms: float, wire: float) -> dict:
    return {"fsdp fp32": {"ms": fp32_ms, "bytes": 800.0, "rs_ms": float("nan"), "wire": 4 * wire},
            "qsgd-4bit": {"ms": q_ms, "bytes": 100.0, "rs_ms": 3.0, "wire": wire}}


def test_loopback_table_has_the_busiest_ranks_bytes_and_rank_0s_time() -> None:
    ranks = [_rank(100.0, 50.0, 1.0), _rank(90.0, 80.0, 1.0)]
    ranks[1]["qsgd-4bit"]["bytes"] = 160.0
    rows = table(ranks).splitlines()
    assert rows[2].split() == ["qsgd-4bit", "160", "5.00x", "50.0", "2.00x", "3.0"]


def test_shaped_table_gives_the_median_over_repeats_its_range_and_the_speed_up() -> None:
    runs = [{"rate": "100mbit", "repeat": k, "ranks": [_rank(f, q, 1e6 * (k + 1)), _rank(f, q, 2e6)]}
            for k, (f, q) in enumerate([(300.0, 100.0), (100.0, 300.0), (200.0, 200.0)])]
    runs.append({"rate": "1gbit", "repeat": 0, "ranks": [_rank(40.0, 10.0, 1e6), _rank(40.0, 10.0, 1e6)]})
    rows = [r.split() for r in shaped_table(runs).splitlines()[1:]]
    assert rows[0] == ["100mbit", "fsdp", "fp32", "800", "1.00x", "8.00", "200", "[100-300]", "1.00x"]
    # wire: per repeat the busiest rank (2, 2, 3 MB), then the median over repeats
    assert rows[1] == ["100mbit", "qsgd-4bit", "100", "8.00x", "2.00", "200", "[100-300]", "1.00x"]
    assert rows[3] == ["1gbit", "qsgd-4bit", "100", "8.00x", "1.00", "10", "[10-10]", "4.00x"]
