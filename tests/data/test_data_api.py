"""load_dataset's registry, the seeded stratified helpers, subsets and the synthetic set."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dqsgd.data import DATASETS, Dataset, Split, load_dataset, stratified_sample, stratified_split
from dqsgd.data import _LOADERS
from dqsgd.data.base import subset_split


def test_registry_and_unknown_names() -> None:
    assert set(DATASETS) == set(_LOADERS) == {"mnist", "fashion-mnist", "bbcnews", "cifar10", "cifar100",
                                              "agnews", "synthetic"}
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'.*cifar10.*mnist.*synthetic"):
        load_dataset("imagenet")


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 30), min_size=1, max_size=6), frac=st.floats(0.0, 1.0), seed=st.integers(0, 99))
def test_stratified_sample_keeps_every_class_share(counts: list[int], frac: float, seed: int) -> None:
    y = torch.cat([torch.full((c,), k) for k, c in enumerate(counts)])
    y = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))]
    n = round(frac * len(y))
    idx = stratified_sample(y, n, torch.Generator().manual_seed(seed))
    assert len(idx) == n and len(set(idx.tolist())) == n
    picked = torch.bincount(y[idx], minlength=len(counts)).tolist()
    for c, p in zip(counts, picked):
        assert abs(p - c * n / len(y)) < 1  # each class gets floor or ceil of its exact share


def test_stratified_split_is_seeded_and_disjoint() -> None:
    y = torch.arange(200) % 3
    tr, te = stratified_split(y, 0.2, seed=5)
    assert sorted(torch.cat([tr, te]).tolist()) == list(range(200)) and len(te) == 40
    tr2, te2 = stratified_split(y, 0.2, seed=5)
    assert torch.equal(tr, tr2) and torch.equal(te, te2)
    _, te3 = stratified_split(y, 0.2, seed=6)
    assert set(te.tolist()) != set(te3.tolist())
    with pytest.raises(ValueError):
        stratified_split(y, 1.0, seed=0)


def test_synthetic_is_seeded_balanced_and_standardised() -> None:
    a, b, c = load_dataset("synthetic"), load_dataset("synthetic"), load_dataset("synthetic", seed=1)
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10 and a.kind == "image"
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert not torch.equal(a.train.x, c.train.x)
    assert torch.bincount(a.train.y).tolist() == [103] * 4 + [102] * 6
    assert abs(a.train.x.mean().item()) < 1e-5 and abs(a.train.x.std().item() - 1) < 1e-4


def test_subset_is_stratified_seeded_and_leaves_the_test_set() -> None:
    full = load_dataset("synthetic")
    s1, s2 = load_dataset("synthetic", subset=100), load_dataset("synthetic", subset=100)
    assert len(s1.train) == 100 and torch.bincount(s1.train.y).tolist() == [10] * 10
    assert torch.equal(s1.train.x, s2.train.x) and torch.equal(s1.test.x, full.test.x)
    other = subset_split(full.train, 100, seed=1)  # same data, another seed: another subset
    assert not torch.equal(other.x, s1.train.x) and torch.bincount(other.y).tolist() == [10] * 10
    rows = {tuple(r) for r in full.train.x.flatten(1).tolist()}
    assert all(tuple(r) in rows for r in s1.train.x.flatten(1).tolist())  # a subset, not new samples
    assert load_dataset("synthetic", subset=10**6).train.x.shape == full.train.x.shape
    with pytest.raises(ValueError):
        load_dataset("synthetic", subset=0)


def test_records_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="int64"):
        Split(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows"):
        Split(torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64))
    split = Split(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="kind"):
        Dataset("x", split, split, 2, (3,), "audio")
    with pytest.raises(ValueError, match="input_shape"):
        Dataset("x", split, split, 2, (4,), "text")
