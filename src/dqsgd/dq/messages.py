"""Envelopes of the asynchronous protocol [OC]: a few bytes in front of every codec payload.

Every message that crosses the wire is ``envelope ∥ payload`` and the ledger counts all of it
(``len(bytes)``). Transport framing below that (torch.distributed's int64 size prefix) is not
counted, like TCP/IP headers.

Uplink (worker → master), 15 bytes + payload::

    kind u8 (1 GRAD, 2 FULLGRAD) | worker u16 | seq u32 | epoch u32 | version u32 | payload

``seq`` numbers a worker's messages from 0 (so (worker, seq) identifies a message for the
exactly-once checks); ``version`` is D(t), the master's update counter when the model that this
gradient was computed at was sent (0 = the epoch's start point).

Downlink (master → one worker), 9 bytes + payload::

    kind u8 (1 SYNC_X, 2 SYNC_G, 3 MODEL, 4 HOLD, 5 STOP) | epoch u32 | version u32 | payload

SYNC_X carries the snapshot x̃ and SYNC_G the full gradient ∇f(x̃), both fp32 (epoch-sync traffic);
MODEL carries a model message (:mod:`dqsgd.dq.modelq`); HOLD (no new work until the next epoch)
and STOP carry nothing.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from dqsgd.codecs import PayloadError

__all__ = ["Up", "Down", "UpKind", "DownKind", "pack_up", "unpack_up", "pack_down", "unpack_down"]

_UP = struct.Struct("<BHIII")
_DOWN = struct.Struct("<BII")


class UpKind(enum.IntEnum):
    GRAD = 1
    FULLGRAD = 2


class DownKind(enum.IntEnum):
    SYNC_X = 1
    SYNC_G = 2
    MODEL = 3
    HOLD = 4
    STOP = 5


@dataclass(frozen=True)
class Up:
    kind: UpKind
    worker: int
    seq: int
    epoch: int
    version: int
    payload: bytes


@dataclass(frozen=True)
class Down:
    kind: DownKind
    epoch: int
    version: int
    payload: bytes = b""


def pack_up(m: Up) -> bytes:
    return _UP.pack(m.kind, m.worker, m.seq, m.epoch, m.version) + m.payload


def unpack_up(data: bytes) -> Up:
    if len(data) < _UP.size:
        raise PayloadError(f"uplink message of {len(data)} bytes is shorter than its {_UP.size}-byte envelope")
    kind, worker, seq, epoch, version = _UP.unpack_from(data)
    try:
        k = UpKind(kind)
    except ValueError:
        raise PayloadError(f"unknown uplink kind {kind}") from None
    return Up(k, worker, seq, epoch, version, bytes(data[_UP.size:]))


def pack_down(m: Down) -> bytes:
    return _DOWN.pack(m.kind, m.epoch, m.version) + m.payload


def unpack_down(data: bytes) -> Down:
    if len(data) < _DOWN.size:
        raise PayloadError(f"downlink message of {len(data)} bytes is shorter than its {_DOWN.size}-byte envelope")
    kind, epoch, version = _DOWN.unpack_from(data)
    try:
        k = DownKind(kind)
    except ValueError:
        raise PayloadError(f"unknown downlink kind {kind}") from None
    return Down(k, epoch, version, bytes(data[_DOWN.size:]))
