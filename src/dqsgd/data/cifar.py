"""CIFAR-10 and CIFAR-100 from their "python version" releases, read with a restricted unpickler.

Layout (https://www.cs.toronto.edu/~kriz/cifar.html): ``cifar-10-batches-py/data_batch_1..5`` and
``test_batch``; ``cifar-100-python/train`` and ``test``. Each file is a Python-2 pickle (protocol 2)
of a dict with bytes keys: ``b'data'`` a uint8 array ``(N, 3072)`` (1024 red, 1024 green, 1024 blue
values, each a row-major 32×32 plane), and ``b'labels'`` (CIFAR-10) or ``b'fine_labels'`` (CIFAR-100,
the 100-class labels) as a list of ints, plus names and filenames we ignore.

``pickle.load`` runs arbitrary code: a pickle may name any callable and ask to call it. The
:class:`RestrictedUnpickler` resolves only the few globals those files contain (numpy's array
reconstruction, ``ndarray``, ``dtype``, and ``_codecs.encode`` for bytes in Python-3 protocol-2
pickles), refuses everything else, and the result is then checked for shape and type.

Normalisation (per channel, training pixels in [0, 1], the usual published constants):
CIFAR-10 mean (0.4914, 0.4822, 0.4465), std (0.2470, 0.2435, 0.2616);
CIFAR-100 mean (0.5071, 0.4865, 0.4409), std (0.2673, 0.2564, 0.2762).
"""

from __future__ import annotations

import codecs
import io
import pickle
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from numpy._core import multiarray as _multiarray

from .base import Dataset, DatasetNotFoundError, Split, check_md5, normalize_images

__all__ = ["RestrictedUnpickler", "UnsafePickleError", "load_cifar", "restricted_loads", "CIFAR_STATS"]

CIFAR_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}

_LAYOUT = {  # name → (folder, train files, test files, label key, classes, archive, archive md5)
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
                "labels", 10, "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "fine_labels", 100,
                 "cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle asked for something a CIFAR file never contains."""


def _safe_dtype(spec: Any, align: bool = False, copy: bool = False) -> np.dtype:
    """``numpy.dtype`` for plain numeric dtypes only (object dtypes would unpickle Python objects)."""
    if not isinstance(spec, (str, bytes)):
        raise UnsafePickleError(f"refusing dtype spec of type {type(spec).__name__}")
    dt = np.dtype(spec.decode("ascii") if isinstance(spec, bytes) else spec, align=bool(align), copy=bool(copy))
    if dt.hasobject:
        raise UnsafePickleError(f"refusing object dtype {dt}")
    return dt


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for bytes: latin-1 only."""
    try:
        name = codecs.lookup(encoding).name
    except (LookupError, TypeError):
        name = None
    if name != "iso8859-1" or not isinstance(text, str):
        raise UnsafePickleError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


_ALLOWED: dict[tuple[str, str], Callable[..., Any] | type] = {
    ("numpy.core.multiarray", "_reconstruct"): _multiarray._reconstruct,  # Python-2 / numpy<2 pickles
    ("numpy._core.multiarray", "_reconstruct"): _multiarray._reconstruct,  # numpy>=2 pickles
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _safe_dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals listed in ``_ALLOWED``; anything else raises."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"refusing to load global {module}.{name}: CIFAR files contain only numpy arrays, "
                "dtypes and plain containers"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refusing persistent ids")


def restricted_loads(data: bytes) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler` (Python-2 strings come back as bytes)."""
    return RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()


def _key(obj: dict[Any, Any], key: str, path: Path) -> Any:
    for k in (key.encode("ascii"), key):
        if k in obj:
            return obj[k]
    raise ValueError(f"{path}: no {key!r} entry (keys: {sorted(map(repr, obj))})")


def _read_batch(path: Path, name: str, label_key: str, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR pickle → uint8 images ``(N, 3, 32, 32)`` and int64 labels ``(N,)``, validated."""
    data = path.read_bytes()
    check_md5(data, name, path.name, path)
    obj = restricted_loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict, got {type(obj).__name__}")
    images = _key(obj, "data", path)
    labels = np.asarray(_key(obj, label_key, path))
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 2 or images.shape[1] != 3072:
        raise ValueError(f"{path}: 'data' must be a uint8 array (N, 3072), got {getattr(images, 'shape', images)!r}")
    if labels.shape != (images.shape[0],) or labels.dtype.kind not in "iu":
        raise ValueError(f"{path}: {label_key!r} must be {images.shape[0]} integers, got {labels.dtype} {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"{path}: labels outside 0..{classes - 1}")
    return images.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def load_cifar(name: str, root: str | Path | None) -> Dataset:
    """Load ``cifar10`` or ``cifar100`` (fine labels) from ``root/<release folder>``, MD5-checked.

    Images become float32 ``(N, 3, 32, 32)`` normalised with :data:`CIFAR_STATS`.
    """
    folder_name, train_files, test_files, label_key, classes, archive, archive_md5 = _LAYOUT[name]
    hint = (f"put {folder_name} under ROOT and pass ROOT (command line: --set train.data_root=ROOT; "
            f"Python: load_dataset({name!r}, root=ROOT)): download "
            f"https://www.cs.toronto.edu/~kriz/{archive} (MD5 {archive_md5}) and extract it in ROOT")
    if root is None:
        raise DatasetNotFoundError(f"{name}: no data folder given (it cannot be installed from a package "
                                   f"registry). To use it, {hint}.")
    folder = Path(root) / folder_name
    mean, std = CIFAR_STATS[name]
    splits = {}
    for which, files in (("train", train_files), ("test", test_files)):
        parts = []
        for file in files:
            path = folder / file
            if not path.is_file():
                raise DatasetNotFoundError(f"{name}: {path} not found. To get it, {hint}.")
            parts.append(_read_batch(path, name, label_key, classes))
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        splits[which] = Split(normalize_images(images, mean, std), torch.from_numpy(labels))
    label = "CIFAR-10" if name == "cifar10" else "CIFAR-100 (fine labels)"
    return Dataset(name=name, train=splits["train"], test=splits["test"], num_classes=classes,
                   input_shape=(3, 32, 32), kind="image", note=f"{label}, Krizhevsky 2009")
