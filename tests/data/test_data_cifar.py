"""CIFAR loaders and the restricted unpickler, on tiny batches written in the release's format."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from dqsgd.data import CHECKSUMS, ChecksumError, DatasetNotFoundError, UnsafePickleError, load_dataset
from dqsgd.data.cifar import restricted_loads


def _register(monkeypatch: pytest.MonkeyPatch, name: str, files: dict[str, bytes]) -> None:
    monkeypatch.setitem(CHECKSUMS, name, {k: hashlib.md5(v).hexdigest() for k, v in files.items()})


@pytest.mark.parametrize("style", ["py3", "py2"])
def test_cifar10_batches_load_in_order_with_channel_planes(tmp_path, formats, monkeypatch, style: str) -> None:
    files = formats.write_cifar10(tmp_path, per_batch=4, style=style)
    _register(monkeypatch, "cifar10", files)
    ds = load_dataset("cifar10", root=tmp_path)
    assert (len(ds.train), len(ds.test)) == (20, 4)
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10 and ds.kind == "image"
    assert ds.train.y.tolist() == [(k + j) % 10 for k in range(1, 6) for j in range(4)]
    # Row layout: 1024 red, then 1024 green, then 1024 blue values, each a row-major 32x32 plane.
    raw = pickle.loads(files["data_batch_2"], encoding="bytes")[b"data"]
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    for c in range(3):
        plane = torch.from_numpy(raw[1, 1024 * c: 1024 * (c + 1)].reshape(32, 32).astype(np.float32)) / 255
        torch.testing.assert_close(ds.train.x[5, c], (plane - mean[c]) / std[c])


def test_cifar100_uses_fine_labels(tmp_path, formats, monkeypatch) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    files = {"train": formats.cifar_batch([0, 57, 99, 42, 3], b"fine_labels", 1),
             "test": formats.cifar_batch([99, 1], b"fine_labels", 2)}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    _register(monkeypatch, "cifar100", files)
    ds = load_dataset("cifar100", root=tmp_path)
    assert ds.num_classes == 100
    assert ds.train.y.tolist() == [0, 57, 99, 42, 3] and ds.test.y.tolist() == [99, 1]
    assert ds.train.x.shape == (5, 3, 32, 32) and ds.train.x.dtype == torch.float32


def test_checksum_mismatch_is_refused(tmp_path, formats) -> None:
    formats.write_cifar10(tmp_path)
    with pytest.raises(ChecksumError, match="data_batch_1.*expected c99cafc1"):
        load_dataset("cifar10", root=tmp_path)


def test_missing_files_say_where_to_put_them(tmp_path) -> None:
    for root in (None, tmp_path):
        with pytest.raises(DatasetNotFoundError, match="put cifar-10-batches-py under ROOT"):
            load_dataset("cifar10", root=root)
        with pytest.raises(DatasetNotFoundError, match="put cifar-100-python under ROOT"):
            load_dataset("cifar100", root=root)


class _Exploit:
    """Unpickling this calls ``os.system`` — with a plain ``pickle.loads``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


def test_a_pickle_that_would_run_a_command_is_refused(tmp_path, formats, monkeypatch) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": _Exploit(f"touch {marker}"), b"labels": [1]}, protocol=2)
    with pytest.raises(UnsafePickleError, match=r"refusing to load global (posix|os|nt)\.system"):
        restricted_loads(payload)
    assert not marker.exists()
    # ... and through the loader, even when its checksum is registered as canonical.
    files = formats.write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(payload)
    _register(monkeypatch, "cifar10", {**files, "data_batch_3": payload})
    with pytest.raises(UnsafePickleError):
        load_dataset("cifar10", root=tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    b"cbuiltins\neval\n(X\x06\x00\x00\x001 + 1tR.",                      # builtins.eval("1 + 1")
    b"\x80\x02cnumpy\nload\nX\x01\x00\x00\x00x\x85R.",                     # numpy.load("x")
    b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x04\x00\x00\x00zlib\x86R.",  # a non-latin-1 codec
])
def test_other_globals_and_codecs_are_refused(payload: bytes) -> None:
    with pytest.raises(UnsafePickleError):
        restricted_loads(payload)


def test_object_arrays_are_refused() -> None:
    with pytest.raises(UnsafePickleError, match="object dtype"):
        restricted_loads(pickle.dumps(np.array([1, "a"], dtype=object), protocol=2))


def test_plain_containers_and_uint8_arrays_load() -> None:
    data = {b"data": np.arange(6, dtype=np.uint8).reshape(2, 3), b"labels": [1, 2], b"name": b"x", "k": (1.5, None)}
    out = restricted_loads(pickle.dumps(data, protocol=2))
    np.testing.assert_array_equal(out[b"data"], data[b"data"])
    assert out[b"labels"] == [1, 2] and out[b"name"] == b"x" and out["k"] == (1.5, None)


def test_wrong_shapes_and_labels_are_refused(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    good = {b"fine_labels": [1], b"data": np.zeros((1, 3072), np.uint8)}
    cases = [{**good, b"data": np.zeros((1, 1024), np.uint8)},
             {**good, b"fine_labels": [100]},
             {**good, b"fine_labels": [1, 2]},
             {b"data": good[b"data"]}]
    for case in cases:
        data = pickle.dumps(case, protocol=2)
        (folder / "train").write_bytes(data)
        (folder / "test").write_bytes(data)
        monkeypatch.setitem(CHECKSUMS, "cifar100", {"train": hashlib.md5(data).hexdigest(),
                                                    "test": hashlib.md5(data).hexdigest()})
        with pytest.raises(ValueError):
            load_dataset("cifar100", root=tmp_path)
