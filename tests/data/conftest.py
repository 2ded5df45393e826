"""Writers for tiny files in the exact on-disk formats the loaders read (IDX, CIFAR pickles, CSV).

Nothing here is downloaded: every test builds its data in ``tmp_path``.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

_IDX_TYPE = {np.dtype("u1"): 0x08, np.dtype("i1"): 0x09, np.dtype("i2"): 0x0B, np.dtype("i4"): 0x0C,
             np.dtype("f4"): 0x0D, np.dtype("f8"): 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    """Uncompressed IDX: 0x0000, type byte, ndim, big-endian uint32 dims, big-endian values."""
    code = _IDX_TYPE[array.dtype.newbyteorder("=")]
    header = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx_set(folder: Path, n_train: int = 30, n_test: int = 10, seed: int = 0,
                  compress: bool = True) -> dict[str, bytes]:
    """Write MNIST-layout files; returns the uncompressed bytes by file stem."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    raw = {stem: idx_bytes(a) for stem, a in arrays.items()}
    for stem, data in raw.items():
        if compress:
            (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / stem).write_bytes(data)
    return raw


def md5s(raw: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.md5(data).hexdigest() for name, data in raw.items()}


# --- CIFAR --------------------------------------------------------------------------------------

def py2_pickle(obj: dict[bytes, Any]) -> bytes:
    """A protocol-2 pickle laid out as Python 2's cPickle wrote the CIFAR release.

    Python-2 ``str`` (SHORT_BINSTRING / BINSTRING) for keys and raw data, and numpy arrays via
    ``numpy.core.multiarray._reconstruct`` (the pre-numpy-2 module name). Handles dicts of bytes,
    lists of small ints and 2-D uint8 arrays: what a CIFAR batch holds.
    """
    def s(b: bytes) -> bytes:
        return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<I", len(b)) + b

    def i(v: int) -> bytes:
        return b"K" + bytes([v]) if 0 <= v < 256 else b"J" + struct.pack("<i", v)

    def arr(a: np.ndarray) -> bytes:
        out = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + i(0) + b"\x85" + s(b"b") + b"\x87R"
        out += b"(" + i(1) + b"(" + b"".join(i(d) for d in a.shape)
        out += b"tcnumpy\ndtype\n" + s(b"u1") + i(0) + i(1) + b"\x87R"
        out += b"(" + i(3) + s(b"|") + b"NNN" + i(-1) + i(-1) + i(0) + b"tb"
        return out + b"\x89" + s(a.tobytes()) + b"tb"

    out = b"\x80\x02}("
    for key, value in obj.items():
        out += s(key)
        if isinstance(value, np.ndarray):
            out += arr(value)
        elif isinstance(value, list):
            out += b"](" + b"".join(i(x) for x in value) + b"e"
        else:
            out += s(value)
    return out + b"u."


def cifar_batch(labels: list[int], label_key: bytes, seed: int, style: str = "py3") -> bytes:
    """A CIFAR batch dict with bytes keys; ``style`` "py3" = ``pickle.dumps(protocol=2)``, "py2" = cPickle."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (len(labels), 3072), dtype=np.uint8)
    batch: dict[bytes, Any] = {b"batch_label": b"training batch", label_key: list(labels), b"data": data,
                               b"filenames": [b"img_%d.png" % k for k in range(len(labels))]}
    if label_key == b"fine_labels":
        batch[b"coarse_labels"] = [x // 5 for x in labels]
    if style == "py2":
        return py2_pickle({k: v for k, v in batch.items() if k != b"filenames"})
    return pickle.dumps(batch, protocol=2)


def write_cifar10(root: Path, per_batch: int = 4, style: str = "py3") -> dict[str, bytes]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for k in range(1, 6):
        files[f"data_batch_{k}"] = cifar_batch([(k + j) % 10 for j in range(per_batch)], b"labels", k, style)
    files["test_batch"] = cifar_batch([j % 10 for j in range(per_batch)], b"labels", 99, style)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def write_agnews(folder: Path, train_rows: list[tuple[int, str, str]], test_rows: list[tuple[int, str, str]]) -> None:
    """AG-News CSV: no header, every field quoted (csv.QUOTE_ALL), class index 1..4 first."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.csv", train_rows), ("test.csv", test_rows)):
        with (folder / name).open("w", newline="", encoding="utf-8") as f:
            csv.writer(f, quoting=csv.QUOTE_ALL).writerows([(str(c), t, d) for c, t, d in rows])


class Formats:
    idx_bytes = staticmethod(idx_bytes)
    write_idx_set = staticmethod(write_idx_set)
    md5s = staticmethod(md5s)
    py2_pickle = staticmethod(py2_pickle)
    cifar_batch = staticmethod(cifar_batch)
    write_cifar10 = staticmethod(write_cifar10)
    write_agnews = staticmethod(write_agnews)


@pytest.fixture
def formats() -> type[Formats]:
    """The file writers above, for tests in this folder."""
    return Formats
