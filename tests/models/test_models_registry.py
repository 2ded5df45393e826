"""build_model: names, dataset checks, parameter counts, deterministic initialisation, training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dqsgd.models import MODELS, DatasetInfo, build_model, count_parameters

MNIST = DatasetInfo(num_classes=10, input_shape=(1, 28, 28), kind="image")
CIFAR10 = DatasetInfo(num_classes=10, input_shape=(3, 32, 32), kind="image")
CIFAR100 = DatasetInfo(num_classes=100, input_shape=(3, 32, 32), kind="image")
SMALL_RGB = DatasetInfo(num_classes=5, input_shape=(3, 8, 8), kind="image")
TEXT = DatasetInfo(num_classes=4, input_shape=(12,), kind="text", vocab_size=50)
SMALL_LSTM = {"embed_dim": 16, "hidden_size": 16, "attention_dim": 8, "fc_dim": 16}

# name → (dataset, options, batch size); resnets kept tiny (batch 4 of 3x8x8) for CPU speed.
CASES: dict[str, tuple[DatasetInfo, dict[str, int], int]] = {
    "logreg": (MNIST, {}, 8),
    "mlp": (MNIST, {}, 8),
    "cnn": (MNIST, {}, 8),
    "resnet18": (SMALL_RGB, {}, 4),
    "resnet34": (SMALL_RGB, {}, 4),
    "bilstm": (TEXT, SMALL_LSTM, 8),
}
# name → (SGD learning rate, steps, fraction by which the loss must fall). Plain SGD moves an
# LSTM slowly from its near-uniform start (Adam would not), hence the small bar for bilstm.
TRAINING: dict[str, tuple[float, int, float]] = {
    "logreg": (0.05, 5, 0.5), "mlp": (0.1, 5, 0.3), "cnn": (0.3, 6, 0.04),
    "resnet18": (0.01, 4, 0.5), "resnet34": (0.005, 5, 0.5), "bilstm": (1.0, 8, 0.01),
}


def _batch(info: DatasetInfo, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % info.num_classes
    if info.kind == "text":
        x = torch.randint(2 + info.num_classes, info.vocab_size, (n, *info.input_shape), generator=gen)
        x[:, 0] = 2 + y  # the first token names the class
        x[1, 7:] = 0  # some padding
        return x, y
    return torch.randn(n, *info.input_shape, generator=gen), y


def test_registry_lists_every_model_and_rejects_unknown_names() -> None:
    assert set(MODELS) == set(CASES)
    with pytest.raises(ValueError, match="unknown model 'vgg19'.*bilstm.*resnet18"):
        build_model("vgg19", MNIST)


@pytest.mark.parametrize("name, info", [("bilstm", MNIST), ("mlp", TEXT), ("resnet18", TEXT)])
def test_model_dataset_mismatch_is_rejected(name: str, info: DatasetInfo) -> None:
    with pytest.raises(ValueError, match=f"model '{name}' reads .* inputs but the dataset is '{info.kind}'"):
        build_model(name, info)


def test_shape_problems_are_explained() -> None:
    with pytest.raises(ValueError, match="at least 12x12"):
        build_model("cnn", DatasetInfo(10, (1, 8, 8)))
    with pytest.raises(ValueError, match="vocabulary"):
        build_model("bilstm", DatasetInfo(4, (12,), "text", vocab_size=0))


@pytest.mark.parametrize("name, info, expected", [
    ("resnet18", CIFAR10, 11_173_962),   # the standard CIFAR ResNet-18 figure
    ("resnet34", CIFAR100, 21_328_292),
    ("mlp", MNIST, 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10),  # 199 210
    ("cnn", MNIST, 61_706),              # LeNet-5
    ("logreg", MNIST, 7_850),
])
def test_parameter_counts(name: str, info: DatasetInfo, expected: int) -> None:
    assert count_parameters(build_model(name, info)) == expected


@pytest.mark.parametrize("name", list(CASES))
def test_initialisation_is_deterministic_under_manual_seed(name: str) -> None:
    info, options, _ = CASES[name]
    torch.manual_seed(7)
    a = build_model(name, info, **options).state_dict()
    torch.manual_seed(7)
    b = build_model(name, info, **options).state_dict()
    torch.manual_seed(8)
    c = build_model(name, info, **options).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two OpenMP threads competing with other
    processes made the resnet steps 10x slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", list(CASES))
def test_output_shape_and_a_few_sgd_steps_reduce_the_loss(name: str, one_thread: None) -> None:
    info, options, n = CASES[name]
    torch.manual_seed(0)
    model = build_model(name, info, **options)
    x, y = _batch(info, n)
    lr, steps, drop = TRAINING[name]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(x)
        assert logits.shape == (n, info.num_classes) and logits.dtype == torch.float32
        loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if not any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):  # batch statistics jitter
        assert all(b < a for a, b in zip(losses, losses[1:])), losses  # every step helps
    assert losses[-1] < (1 - drop) * losses[0], losses


def test_resnets_and_cnn_run_on_one_channel_28x28_and_rgb_32x32() -> None:
    torch.manual_seed(0)
    for name in ("resnet18", "cnn"):
        for info in (MNIST, CIFAR10):
            model = build_model(name, info).eval()
            with torch.no_grad():
                assert model(torch.randn(2, *info.input_shape)).shape == (2, 10)


def test_a_loaded_dataset_is_accepted(tmp_path) -> None:
    from dqsgd.data import load_dataset

    ds = load_dataset("synthetic", subset=20)
    assert build_model("mlp", ds)(ds.train.x[:3]).shape == (3, 10)
