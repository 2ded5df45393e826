"""The tables of `dqsgd bench fsdp` (loopback and shaped links), from given per-rank figures."""

from __future__ import annotations

from dqsgd.cli.bench.fsdp import shaped_table, table


def _rank(fp32_ms: float, q_ms: float, wire: float, bf16_ms: float = 100.0) -> dict:
    return {"fsdp fp32": {"ms": fp32_ms, "bytes": 800.0, "param_bytes": 1600.0, "dqsgd_ms": float("nan"),
                          "wire": 4 * wire},
            "fsdp bf16": {"ms": bf16_ms, "bytes": 400.0, "param_bytes": 1600.0, "dqsgd_ms": float("nan"),
                          "wire": 3 * wire},
            "qsgd-4bit+ag8": {"ms": q_ms, "bytes": 100.0, "param_bytes": 400.0, "dqsgd_ms": 3.0, "wire": wire}}


def test_loopback_table_has_both_legs_bytes_their_total_and_rank_0s_time() -> None:
    ranks = [_rank(100.0, 50.0, 1.0), _rank(90.0, 80.0, 1.0)]
    ranks[1]["qsgd-4bit+ag8"]["bytes"] = 160.0  # rank 1 the busiest in gradients, rank 0 in all-gathers
    ranks[0]["qsgd-4bit+ag8"]["param_bytes"] = 440.0
    rows = table(ranks).splitlines()
    assert rows[0].split() == ["variant", "grad", "B/rank/step", "param", "AG", "B", "total", "B", "vs", "fp32",
                               "ms/step", "speed-up", "ms", "in", "dqsgd", "calls"]
    # total: the busiest rank's sum (540 on rank 0, 560 on rank 1); vs fp32: 2400 / 560
    assert rows[3].split() == ["qsgd-4bit+ag8", "160", "440", "560", "4.29x", "50.0", "2.00x", "3.0"]
    assert rows[1].split() == ["fsdp", "fp32", "800", "1,600", "2,400", "1.00x", "100.0", "1.00x", "nan"]


def test_shaped_table_gives_the_median_over_repeats_its_range_and_the_speed_ups() -> None:
    runs = [{"rate": "100mbit", "repeat": k, "ranks": [_rank(f, q, 1e6 * (k + 1)), _rank(f, q, 2e6)]}
            for k, (f, q) in enumerate([(300.0, 100.0), (100.0, 300.0), (200.0, 200.0)])]
    runs.append({"rate": "1gbit", "repeat": 0, "ranks": [_rank(40.0, 10.0, 1e6, 20.0), _rank(40.0, 10.0, 1e6)]})
    lines = shaped_table(runs).splitlines()
    assert "x-node" not in lines[0]
    rows = [r.split() for r in lines[1:]]
    assert rows[0] == ["100mbit", "fsdp", "fp32", "800", "1,600", "2,400", "1.00x", "8.00", "200", "[100-300]",
                       "1.00x", "0.50x"]
    # wire: per repeat the busiest rank (2, 2, 3 MB), then the median over repeats
    assert rows[2] == ["100mbit", "qsgd-4bit+ag8", "100", "400", "500", "4.80x", "2.00", "200", "[100-300]",
                       "1.00x", "0.50x"]
    assert rows[5] == ["1gbit", "qsgd-4bit+ag8", "100", "400", "500", "4.80x", "1.00", "10", "[10-10]", "4.00x",
                       "2.00x"]


def test_shaped_hsdp_table_adds_the_bytes_sent_to_other_nodes() -> None:
    ranks = [_rank(300.0, 100.0, 1e6), _rank(300.0, 100.0, 1e6)]
    for k, rank in enumerate(ranks):
        for v in rank.values():
            v["cross_wire"] = v["wire"] / 2 * (k + 1)  # rank 1 sends more across
    rows = shaped_table([{"rate": "100mbit", "repeat": 0, "ranks": ranks}]).splitlines()
    assert "x-node MB" in rows[0]
    assert rows[3].split()[6:9] == ["1.00", "1.00", "100"]
