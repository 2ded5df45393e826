"""Sketched SGD's two rounds as a chain of futures (dqsgd.topology.sketched.SketchRank): one rank's part
of a step runs from completion callbacks, so two steps may be in flight on the same groups, each
rank starting them when it gets there, and the bytes are those of the steps run one after the other."""

from __future__ import annotations

import pytest
import torch

from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology.group import local_groups
from dqsgd.topology.server import settle
from dqsgd.topology.sketched import SketchedStep, SketchRank

W, D = 3, 900


def _inputs(s: SketchedStep, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    accs = {w: torch.randn(D, generator=torch.Generator().manual_seed(100 * seed + w)) for w in range(W)}
    return {w: (a, s.cs.sketch(a)) for w, a in accs.items()}


def _outcome(rank: SketchRank) -> tuple:
    chosen, vals, up, down = rank.result  # type: ignore[misc]
    return chosen, vals, up, down, rank.sent


def _same(a: dict[int, tuple], b: dict[int, tuple]) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2:] == y[2:] for x, y in
               ((a[w], b[w]) for w in range(W)))


@pytest.mark.parametrize("topology", ["ps", "allgather", "sharded"])
def test_two_steps_in_flight_give_the_bytes_of_two_steps_in_turn(topology: str) -> None:
    """Ranks 0..W-2 start step A, then step B, before rank W-1 starts either: each rank issues a leg's
    collectives in step order (A holds its turn on the uplink until its values have left, after the
    candidates' downlink), so every rank's results are those of A, then B, run alone."""
    s = SketchedStep(Method(method_config("sketched-sgd", topk_ratio=0.02), D, 3), seed=1, topology=topology,
                     workers=W)
    ins = {n: _inputs(s, n) for n in (0, 1)}

    def start(groups, n: int, w: int):  # type: ignore[no-untyped-def]
        return SketchRank(s, w, groups[w], *ins[n][w], n).start()

    alone = {}
    for n in (0, 1):
        groups = dict(enumerate(local_groups(W)))
        alone[n] = {w: _outcome(r) for w, r in settle(groups, {w: start(groups, n, w) for w in range(W)}).items()}
    assert not _same(alone[0], alone[1])

    groups = dict(enumerate(local_groups(W)))
    futs: dict[int, dict[int, torch.futures.Future]] = {0: {}, 1: {}}
    for w in range(W - 1):
        futs[0][w] = start(groups, 0, w)
    for w in range(W - 1):
        futs[1][w] = start(groups, 1, w)
    assert not any(f.done() for n in futs for f in futs[n].values())  # every one waits for rank W-1
    futs[0][W - 1] = start(groups, 0, W - 1)
    futs[1][W - 1] = start(groups, 1, W - 1)
    for n in (0, 1):
        got = {w: _outcome(r) for w, r in settle(groups, futs[n]).items()}
        assert _same(got, alone[n]), n
