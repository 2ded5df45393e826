"""table1-fashion-resnet: the paper's ResNet-18 on Fashion-MNIST padded to the CIFAR shape (a GPU job;
here the padding is checked exactly and the config trains for a few steps on the CPU)."""

from pathlib import Path

import pytest
import torch

from dqsgd.data import DatasetNotFoundError, load_dataset, pad_images
from dqsgd.experiments.compare import load_data_for
from dqsgd.train.config import ConfigError, load_experiment
from dqsgd.train.runner import run_one


def test_padding_centres_the_image_in_zeros() -> None:
    ds = load_dataset("synthetic")  # 1x8x8
    padded = pad_images(ds, 13)     # odd margin: the extra pixel goes to the bottom/right
    assert padded.input_shape == (1, 13, 13) and padded.train.x.shape[1:] == (1, 13, 13)
    assert torch.equal(padded.train.x[:, :, 2:10, 2:10], ds.train.x)
    inner = torch.zeros(13, 13, dtype=torch.bool)
    inner[2:10, 2:10] = True
    assert not padded.test.x[:, :, ~inner].any()
    assert torch.equal(padded.train.y, ds.train.y) and "zero-padded to 13x13" in padded.note
    assert pad_images(ds, 8).train.x.shape == ds.train.x.shape


def test_padding_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="smaller than"):
        pad_images(load_dataset("synthetic"), 7)
    with pytest.raises(ConfigError):
        load_experiment("table1-fashion-resnet", ["train.pad_to=-1"])


def test_the_config_trains_a_few_steps(tmp_path: Path) -> None:
    exp = load_experiment("table1-fashion-resnet", [
        "train.steps=2", "train.workers=2", "train.batch_size=4", "train.subset=64", "train.eval_samples=32",
        "train.eval_every=2", 'train.device="cpu"', "train.threads=1"])
    assert exp.train.model == "resnet18" and exp.train.pad_to == 32 and exp.train.dataset == "fashion-mnist"
    try:
        data = load_data_for(exp)
    except DatasetNotFoundError as e:
        pytest.skip(f"Fashion-MNIST is not installed here (run `make fashion-data` as root): {e}")
    assert data.input_shape == (1, 32, 32)
    entry = next(e for e in exp.methods if e.label == "dqsgd")
    s = run_one(exp.train, entry, data, 0, tmp_path / "run", progress=False)
    assert s["steps"] == 2 and 0.0 <= s["test_acc"] <= 1.0
    assert s["ledger_up_bytes"] > 0 and s["ledger_compression_ratio"] > 5  # 4.5-bit uplink, measured
