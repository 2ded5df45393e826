"""One size bound for every peer message (dqsgd.topology.refusal): Sketched SGD's index messages, a
cap that is never optional, and non-finite sketches refused on every topology. The forged
announcement over real processes is tests/distributed/test_peer_limits.py."""

from __future__ import annotations

import struct
import zlib
from typing import Callable

import pytest
import torch

from dqsgd.codecs import PayloadError
from dqsgd.codecs.sketch_wire import IndexKind, index_message_size
from dqsgd.codecs.wire import read_header
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology.group import UP, LocalGroup
from dqsgd.topology.refusal import check_sizes
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes
from dqsgd.topology.server import room
from dqsgd.topology.sketched import SketchedStep
from dqsgd.transport import SimTransport

W, D = 3, 900


def _step(topology: str) -> SketchedStep:
    return SketchedStep(Method(method_config("sketched-sgd", topk_ratio=0.01), D, 3), seed=1, topology=topology,
                        workers=W)


def _grads() -> dict[int, torch.Tensor]:
    return {w: torch.randn(D, generator=torch.Generator().manual_seed(w)) for w in range(W)}


def wrapped(wrap: Callable[[int, LocalGroup], None]) -> type[SimTransport]:
    """A simulation whose in-process groups ``wrap(rank, group)`` changes (a recorder, a forger)."""

    class Wrapped(SimTransport):
        def exchange_groups(self):  # type: ignore[no-untyped-def]
            groups = super().exchange_groups()
            for w, g in groups.items():
                wrap(w, g)
            return groups

    return Wrapped


def test_the_sketch_downlinks_are_capped_at_their_exact_size() -> None:
    """M1: the parameter server's candidates and sparse update went out with no cap, so a worker
    allocated whatever size the server announced (2^34 bytes: 17 GB). Each is now a message of its
    exact size (m coordinates, then k coordinates and their values) and a status byte, known to every
    rank before it arrives: nothing is announced."""
    step = _step("ps")
    sizes: list[int] = []

    def record(w: int, g: LocalGroup) -> None:
        g.broadcast = lambda t, src, leg, cast=g.broadcast: (sizes.append(t.numel()), cast(t, src, leg))[1]

    step.run(wrapped(record)(W, "ps"), _grads(), step.method.init_state(W), 0, {})
    assert sizes == [room(index_message_size(D, step.m, IndexKind.INDICES) + 1)] * W + [
        room(index_message_size(D, step.k, IndexKind.SPARSE) + 1)] * W


def test_a_received_size_without_a_cap_is_a_type_error() -> None:
    """No peer message goes unbounded: None is not a cap (it used to mean 'accept any size')."""
    with pytest.raises(TypeError, match="integer cap"):
        check_sizes([1 << 34], [None], "rank 1: the server")  # type: ignore[list-item]
    with pytest.raises(PayloadError, match="announced a payload of 17179869184 bytes"):
        check_sizes([1 << 34], [4096], "rank 1: the server")


def _nan_sketch(payload: bytes) -> bytes:
    """A worker's SKETCH payload with a NaN in its first value (crc made right)."""
    b = bytearray(payload)
    at = read_header(payload).body_start
    b[at : at + 4] = struct.pack("<f", float("nan"))
    b[-4:] = struct.pack("<I", zlib.crc32(bytes(b[:-4])))
    return bytes(b)


def nan_first_sketch(w: int, g: LocalGroup) -> None:
    """Worker 1's sketch (its first uplink: to the server, to every rank, or its first column block to
    rank 0) leaves with a NaN in it."""
    if w != 1:
        return
    gather, all_gather, all_to_all = g.gather, g.all_gather, g.all_to_all

    def nan(t: torch.Tensor, n: int | None = None) -> torch.Tensor:
        n = t.numel() if n is None else n
        return torch.cat([bytes_tensor(_nan_sketch(tensor_bytes(t[:n]))), t[n:]])

    first = [True]

    def once(t: torch.Tensor, n: int | None = None) -> torch.Tensor:
        out, first[0] = (nan(t, n) if first[0] else t), False
        return out

    g.gather = lambda t, dst, leg: gather(once(t), dst, leg)
    g.all_gather = lambda t, leg: all_gather(once(t) if leg == UP else t, leg)
    g.all_to_all = lambda t, s, r, leg: all_to_all(once(t, s[0]), s, r, leg)


@pytest.mark.parametrize("topology", ["ps", "allgather", "sharded"])
def test_a_worker_sketch_with_a_nan_is_refused_on_every_topology(topology: str) -> None:
    """L14: the parameter-server path summed a NaN in worker 1's sketch into the candidates' estimates;
    now every topology refuses it while decoding, naming the worker."""
    step = _step(topology)
    with pytest.raises(PayloadError, match="worker 1: SKETCH payload decodes to values beyond float32 or not finite"):
        step.run(wrapped(nan_first_sketch)(W, topology), _grads(), step.method.init_state(W), 0, {})
