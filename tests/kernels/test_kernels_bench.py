"""The measuring helpers of dqsgd.cli.bench.common (the timed runs themselves are `dqsgd bench ...`)."""

import math

import numpy as np
import pytest

from dqsgd.cli.bench.common import best_of, coded_sizes, level_entropy


def test_level_entropy_of_known_distributions() -> None:
    assert level_entropy(np.zeros(100, dtype=np.int32)) == 0.0
    assert level_entropy(np.array([-1, 1] * 50, dtype=np.int32)) == pytest.approx(1.0)
    codes = np.array([0] * 50 + [1] * 25 + [-1] * 25, dtype=np.int32)
    assert level_entropy(codes) == pytest.approx(1.5)


def test_coded_sizes_measure_real_bodies() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(-7, 8, 10_001).astype(np.int32)  # uniform over 15 levels: log2(15) bits
    sizes = coded_sizes(codes, 4)
    assert sizes["fixed"] == 8 * math.ceil(10_001 * 4 / 8) / 10_001
    assert sizes["zstd_aligned"] == sizes["zstd"]  # 4-bit fields are already byte-aligned
    assert math.log2(15) * 0.99 < sizes["zstd"] < 4.2
    assert sizes["auto"] == min(sizes["fixed"], sizes["elias"], sizes["zstd_aligned"], sizes["rans"])
    # rANS: the entropy of 15 equiprobable levels (≈ log2 15) plus a 46-byte table and 4 state bytes.
    assert math.log2(15) < sizes["rans"] < math.log2(15) * 1.002 + 8 * 50 / 10_001
    sparse = (rng.random(10_001) < 0.05) * rng.choice([-1, 1], 10_001)  # p0 = 0.95: rANS approaches H
    sp = coded_sizes(sparse.astype(np.int32), 2)
    h = level_entropy(sparse)
    assert sp["rans"] < h * 1.01 + 8 * 16 / 10_001 and sp["rans"] < sp["zstd"] and sp["auto"] == sp["rans"]
    six = coded_sizes(rng.integers(-31, 32, 10_001).astype(np.int32), 6)  # one code per byte: zstd sees whole codes
    assert six["zstd_aligned"] < six["zstd"] and six["zstd_aligned"] < math.log2(63) * 1.03


def test_best_of_times_every_callable() -> None:
    calls = []
    best = best_of({"copy": lambda: calls.append("c"), "x": lambda: calls.append("x")}, 3, copy_factor=2)
    assert set(best) == {"copy", "x"} and calls.count("c") == 6 and calls.count("x") == 3
    assert all(0 <= v < 1 for v in best.values())


def test_bench_step_runs_every_variant(tmp_path) -> None:
    """`dqsgd bench step` end to end (one timed step; the numbers themselves are not checked)."""
    import json

    from dqsgd.cli.commands import main

    out = tmp_path / "step.json"
    assert main(["bench", "step", "--config", "table1-mnist", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"sgd", "dqsgd (torch)", "dqsgd (fused)", "sgd (vmap workers)", "dqsgd (fused, vmap workers)"}
    assert rows["sgd"]["vs_sgd"] == 1.0 and all(r["median_ms"] > 0 for r in rows.values())
