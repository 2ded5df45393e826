"""The workers' shards: the Dirichlet label-skewed partition is seeded, disjoint, covers the training
set, gives every worker at least one batch, and is skewed as α says; the IID split is unchanged."""

import pytest
import torch

from dqsgd.train.sampling import WorkerBatches, dirichlet_shards, partition_shards

LABELS = torch.arange(10).repeat_interleave(600)[torch.randperm(6000, generator=torch.Generator().manual_seed(3))]


def top_class_share(shards: list[torch.Tensor]) -> float:
    """Mean over workers of the share of its most frequent class (IID, 10 classes: about 0.1)."""
    return sum(float(torch.bincount(LABELS[s], minlength=10).max()) / len(s) for s in shards) / len(shards)


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0])
def test_dirichlet_shards_are_seeded_disjoint_and_cover_the_set(alpha: float) -> None:
    shards = dirichlet_shards(LABELS, 8, alpha, seed=0, min_size=32)
    assert all(torch.equal(a, b) for a, b in zip(shards, dirichlet_shards(LABELS, 8, alpha, seed=0, min_size=32)))
    assert any(not torch.equal(a, b) for a, b in zip(shards, dirichlet_shards(LABELS, 8, alpha, seed=1, min_size=32)))
    everything = torch.cat(shards)
    assert len(everything) == len(LABELS) and torch.equal(everything.sort().values, torch.arange(len(LABELS)))
    assert min(len(s) for s in shards) >= 32


def test_small_alpha_skews_the_labels_and_large_alpha_does_not() -> None:
    skewed = top_class_share(dirichlet_shards(LABELS, 8, 0.1, seed=0))
    mild = top_class_share(dirichlet_shards(LABELS, 8, 100.0, seed=0))
    iid = top_class_share(WorkerBatches(len(LABELS), 8, 32, 0).shards)
    assert skewed > 0.5, skewed          # most of a worker's samples are of one or two classes
    assert mild < 0.15 and iid < 0.15, (mild, iid)


def test_partition_choice_and_refusals() -> None:
    assert partition_shards("iid", LABELS, 8, 0.1, 32, 0) is None  # WorkerBatches' own seeded split
    got = partition_shards("dirichlet", LABELS, 8, 0.1, 32, 0)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, dirichlet_shards(LABELS, 8, 0.1, 0, 32)))
    with pytest.raises(ValueError, match="fewer than 2000 \\(one batch\\)"):
        dirichlet_shards(LABELS, 8, 0.01, seed=0, min_size=2000)
    with pytest.raises(ValueError, match="partition must be"):
        partition_shards("skewed", LABELS, 8, 0.1, 32, 0)
    with pytest.raises(ValueError, match="shards of at least one batch"):
        WorkerBatches(len(LABELS), 2, 32, 0, [torch.arange(10), torch.arange(10, 6000)])
