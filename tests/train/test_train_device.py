"""``train.device``: validated, resolved (auto → CUDA when available), used by train and compare."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dqsgd.cli.commands import main
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.train.config import ConfigError, TrainConfig, build_experiment, resolve_device
from dqsgd.train.trainer import codec_input

TINY = ["--set", "train.dataset=synthetic", "--set", "train.model=mlp", "--set", "train.steps=2",
        "--set", "train.workers=2", "--set", "train.batch_size=4", "--quiet"]


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:0", ""])
def test_unknown_devices_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match=f"train: device must be 'auto', 'cpu' or 'cuda', got {bad!r}"):
        TrainConfig(device=bad)
    with pytest.raises(ConfigError, match="device must be"):
        resolve_device(bad)
    with pytest.raises(ConfigError, match="train.device must be str"):
        build_experiment({"train": {"device": 1}})


def test_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TrainConfig().device == "auto"
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="train.device = 'cuda', but CUDA is not available"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("command", [["train", "--method", "qsgd-4bit"], ["compare", "--methods", "qsgd-4bit"]])
def test_cli_refuses_cuda_without_cuda(command: list[str], monkeypatch: pytest.MonkeyPatch, capsys,
                                       tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(command + TINY + ["--set", "train.device=cuda", "--out", str(tmp_path / "r")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before anything is written


def test_cli_trains_on_the_resolved_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[torch.device] = []
    import dqsgd.train.runner as runner

    real = runner.Trainer

    def spy(*args, **kw):
        seen.append(torch.device(args[5] if len(args) > 5 else kw["device"]))
        return real(*args, **kw)

    monkeypatch.setattr(runner, "Trainer", spy)
    assert main(["train", "--method", "qsgd-4bit", *TINY, "--set", "train.device=cpu", "--out", str(tmp_path)]) == 0
    assert main(["compare", "--methods", "sgd", *TINY, "--out", str(tmp_path / "c")]) == 0
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert seen == [torch.device("cpu"), expected]


class _OnDevice:
    """A stand-in for a gradient on a non-CPU device (this test runs without one)."""

    device = torch.device("cuda", 0)

    def cpu(self) -> str:
        return "copied to the CPU"


@pytest.mark.parametrize(("name", "overrides", "stays"), [
    ("qsgd-4bit", {"kernel": "fused"}, True),
    ("qsgd-4bit", {"kernel": "fused", "coding": "elias"}, True),
    ("qsgd-4bit", {"kernel": "torch"}, False),
    ("qsgd-4bit", {"kernel": "fused", "error_feedback": True}, False),
    ("terngrad", {}, False),
])
def test_codec_input_moves_to_the_cpu_only_where_the_encoder_needs_it(name: str, overrides: dict,
                                                                      stays: bool) -> None:
    method = Method(method_config(name, **overrides), 100, 10, [100])
    g = _OnDevice()
    assert codec_input(g, method) is g if stays else codec_input(g, method) == "copied to the CPU"
    cpu = torch.ones(3)
    assert codec_input(cpu, method) is cpu
