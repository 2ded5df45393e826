"""The variant names of `dqsgd bench fsdp` and examples/fsdp_train.py (dqsgd.cli.bench.fsdp.variant)."""

from __future__ import annotations

import pytest

from dqsgd.cli.bench.fsdp import Variant, variant


@pytest.mark.parametrize("name,want", [
    ("fsdp fp32", Variant("fsdp fp32")),
    ("fsdp bf16", Variant("fsdp bf16", bf16=True)),
    ("qsgd-4bit", Variant("qsgd-4bit", method="qsgd-4bit")),
    ("ag8", Variant("ag8", param_bits=8)),
    ("qsgd-4bit+ag4", Variant("qsgd-4bit+ag4", method="qsgd-4bit", param_bits=4)),
    ("rep:dqsgd", Variant("rep:dqsgd", replicate="dqsgd")),
    ("rep:dqsgd+wait", Variant("rep:dqsgd+wait", replicate="dqsgd", wait=True)),
    ("fsdp bf16+rep:qsgd-4bit+ag32", Variant("fsdp bf16+rep:qsgd-4bit+ag32", bf16=True, param_bits=32,
                                             replicate="qsgd-4bit")),
])
def test_variant_names_the_legs(name: str, want: Variant) -> None:
    assert variant(name) == want


def test_an_empty_part_is_refused() -> None:
    with pytest.raises(ValueError, match="an empty part"):
        variant("qsgd-4bit++ag8")


def test_wait_needs_a_replicate_leg() -> None:
    with pytest.raises(ValueError, match=r"\+wait applies to a replicate leg"):
        variant("qsgd-4bit+wait")


@pytest.mark.parametrize("nodes", ["0", "3"])
def test_bench_fsdp_refuses_nodes_that_do_not_divide_the_ranks(nodes: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dqsgd.cli import main

    assert main(["bench", "fsdp", "--world", "4", "--nodes", nodes, "--out", ""]) == 2
    assert f"--nodes {nodes} does not divide --world 4" in capsys.readouterr().err
