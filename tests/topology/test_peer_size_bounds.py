"""One size bound for every peer message (dqsgd.topology.limits): Sketched SGD's index messages, a
cap that is never optional, and non-finite sketches refused on every topology. The forged
announcement over real processes is tests/distributed/test_peer_limits.py."""

from __future__ import annotations

import struct
import zlib
from typing import Sequence

import pytest
import torch

from dqsgd.codecs import PayloadError
from dqsgd.codecs.sketch_wire import IndexKind, index_message_size
from dqsgd.codecs.wire import read_header
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology.limits import check_sizes
from dqsgd.topology.sketched import SketchedStep
from dqsgd.transport import SimTransport

W, D = 3, 900


def _step(topology: str) -> SketchedStep:
    return SketchedStep(Method(method_config("sketched-sgd", topk_ratio=0.01), D, 3), seed=1, topology=topology,
                        workers=W)


def _grads() -> dict[int, torch.Tensor]:
    return {w: torch.randn(D, generator=torch.Generator().manual_seed(w)) for w in range(W)}


class Recording(SimTransport):
    """Records the cap each downlink broadcast is given."""

    def __init__(self, workers: int, topology: str):
        super().__init__(workers, topology)
        self.caps: list[object] = []

    def broadcast(self, payload, ints, max_bytes=None):  # type: ignore[no-untyped-def]
        self.caps.append(max_bytes)
        return super().broadcast(payload, ints, max_bytes)


def test_the_sketch_downlinks_are_capped_at_their_exact_size() -> None:
    """M1: the parameter server's candidates and sparse update went out with no cap, so a worker
    allocated whatever size the server announced (2^34 bytes: 17 GB). Each now has its exact size
    as its cap: m coordinates, then k coordinates and their values."""
    step = _step("ps")
    t = Recording(W, "ps")
    step.run(t, _grads(), step.method.init_state(W), 0, {})
    assert t.caps == [index_message_size(D, step.m, IndexKind.INDICES), index_message_size(D, step.k, IndexKind.SPARSE)]


def test_a_received_size_without_a_cap_is_a_type_error() -> None:
    """No peer message goes unbounded: None is not a cap (it used to mean 'accept any size')."""
    with pytest.raises(TypeError, match="integer cap"):
        check_sizes([1 << 34], [None], "rank 1: the server")  # type: ignore[list-item]
    with pytest.raises(TypeError):
        SimTransport(1).broadcast(b"x", [0])  # type: ignore[call-arg]
    with pytest.raises(PayloadError, match="announced a payload of 17179869184 bytes"):
        check_sizes([1 << 34], [4096], "rank 1: the server")


def _nan_sketch(payload: bytes) -> bytes:
    """A worker's SKETCH payload with a NaN in its first value (crc made right)."""
    b = bytearray(payload)
    at = read_header(payload).body_start
    b[at : at + 4] = struct.pack("<f", float("nan"))
    b[-4:] = struct.pack("<I", zlib.crc32(bytes(b[:-4])))
    return bytes(b)


class NanSketch(SimTransport):
    """Worker 1's sketch (the first uplink) arrives with a NaN in it."""

    def gather(self, payloads: Sequence[bytes], max_bytes: int):  # type: ignore[override]
        out = super().gather(payloads, max_bytes)
        if not getattr(self, "_done", False):
            self._done = True
            out[1] = _nan_sketch(out[1])
        return out

    def exchange(self, rows, max_bytes):  # type: ignore[no-untyped-def]
        served, sizes = super().exchange(rows, max_bytes)
        if not getattr(self, "_done", False):
            self._done = True
            served[0][1] = _nan_sketch(served[0][1])
        return served, sizes


@pytest.mark.parametrize("topology", ["ps", "allgather", "sharded"])
def test_a_worker_sketch_with_a_nan_is_refused_on_every_topology(topology: str) -> None:
    """L14: the parameter-server path summed a NaN in worker 1's sketch into the candidates' estimates;
    now every topology refuses it while decoding, naming the worker."""
    step = _step(topology)
    with pytest.raises(PayloadError, match="worker 1: SKETCH payload decodes to values beyond float32 or not finite"):
        step.run(NanSketch(W, topology), _grads(), step.method.init_state(W), 0, {})
