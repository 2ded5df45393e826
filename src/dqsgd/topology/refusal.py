"""How a payload is refused, and how a refusal reaches every rank.

**Sizes.** One size bound for everything a peer announces, refused before a byte is allocated. A
receiver always knows how many elements a payload may carry, hence the most bytes any valid coding of
them can take (:meth:`dqsgd.method.pipeline.Method.max_payload_bytes`, the downlink's exact size,
:func:`dqsgd.codecs.sketch_wire.index_message_size` for Sketched SGD's index messages); a peer's
announced size above that cap raises :class:`~dqsgd.codecs.PayloadError` naming the peer and the cap.
Every rank sees the same announcements (they travel in an all-gather), so every rank refuses together
and nobody waits.

Every received size goes through :func:`check_sizes`, and a cap is never optional: the transports
(``gather``, ``broadcast``, ``exchange``, ``share``, the backup workers' point-to-point messages),
the DDP hook's and FSDP's exchanges all take one, and a missing cap (None) is a TypeError, not an
unbounded receive.

**Refusals.** A message whose last byte is its status (0: fine; 1: the sender refused a payload it
received) and, when set, the error's type and text before it. Every exchange
(:mod:`dqsgd.topology.exchange`, the server's :mod:`dqsgd.topology.server`, the sketch, FSDP's
all-gather) writes and reads refusals with these functions, so every rank raises the same error type
with the same text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from dqsgd.topology import payloads as codec
from dqsgd.topology.group import DOWN, then

if TYPE_CHECKING:
    from dqsgd.topology.group import Group

__all__ = ["ROOM", "check_sizes", "check_table", "failure_message", "opened", "raise_if_refused", "refused", "relay"]

ROOM = 256  # bytes a status message keeps for a refusal's type and text, at least


def check_sizes(sizes: Sequence[int], caps: Sequence[int], who: str) -> None:
    """Refuse (PayloadError) an announced payload size above its cap, before anything is allocated.

    ``caps[j]`` caps ``sizes[j]``; one cap applies to every size. A cap that is not an integer
    (None: a caller that gave none) is a TypeError: no peer message goes unbounded.
    """
    from dqsgd.codecs import PayloadError  # here: importing the hook loads no codec

    caps = list(caps) * len(sizes) if len(caps) == 1 else list(caps)
    if len(caps) != len(sizes):
        raise ValueError(f"{len(caps)} caps for {len(sizes)} sizes")
    if not all(isinstance(c, int) for c in caps):
        raise TypeError(f"{who}: every received size needs an integer cap, got {caps}")
    for j, (n, cap) in enumerate(zip(sizes, caps)):
        if n < 0 or n > cap:
            piece = f" (shard {j})" if len(sizes) > 1 else ""
            raise PayloadError(f"{who} announced a payload of {n} bytes{piece}; the method produces at most "
                               f"{cap} bytes here: refused before allocating")


def check_table(table: Sequence[Sequence[int]], caps: Sequence[int], who: str) -> None:
    """:func:`check_sizes` of every rank's row ``table[w]`` (rank w's sizes, one per shard)."""
    for w, row in enumerate(table):
        check_sizes(row, caps, f"{who}rank {w}")


def failure_message(err: Exception, size: int, device: torch.device) -> torch.Tensor:
    """A message of ``size`` bytes saying that its sender refused a payload: the error's type and text
    (cut to fit), then the status byte 1."""
    text = f"{type(err).__name__}: {err}".encode()[: size - 1]
    msg = codec.bytes_tensor(text, device, size)
    msg[-1] = 1
    return msg


def raise_if_refused(msg: torch.Tensor, head: str, failed: str | None = None) -> None:
    """Raise the error ``msg`` carries (PayloadError or ProtocolError, its text after ``head``) if its
    status byte is set. ``failed``: the head of a sender whose own exchange failed (a collective that
    timed out, a peer that closed its connection) rather than refusing a payload: that error is raised
    as a RuntimeError after ``failed``, its type in its text, and not called a refusal."""
    from dqsgd.codecs import PayloadError
    from dqsgd.method.pipeline import ProtocolError

    if int(msg[-1]):
        text = codec.tensor_bytes(msg[:-1]).rstrip(b"\0").decode(errors="replace")
        kind, _, text = text.partition(": ")
        if failed is not None and kind not in ("PayloadError", "ProtocolError"):
            raise RuntimeError(f"{failed}: {kind}: {text}")
        raise (ProtocolError if kind == "ProtocolError" else PayloadError)(f"{head}: {text}")


def refused(msgs: Sequence[torch.Tensor], head: Callable[[int], str],
            failed: Callable[[int], str] | None = None) -> None:
    """Raise the error of the first message (rank order) whose status is set, after ``head(its rank)``
    (``failed(its rank)`` for an error that is not a refusal: :func:`raise_if_refused`)."""
    for j, m in enumerate(msgs):
        raise_if_refused(m, head(j), None if failed is None else failed(j))


def opened(msg: torch.Tensor, who: str) -> bytes:
    """A message's bytes before its status byte; where its sender (``who``) refused a payload, that
    error, raised with its type and text."""
    raise_if_refused(msg, f"{who} refused a payload")
    return codec.tensor_bytes(msg[:-1])


def relay(group: Group, error: Exception | None, head: Callable[[int], str],
          failed: Callable[[int], str] | None = None) -> Any:
    """One all-gather of every rank's status message (:func:`failure_message` of ``error``, or status 0):
    a future that fails with the first failing rank's error (:func:`refused`) on every rank."""
    size = ROOM + 1
    mine = torch.zeros(size, dtype=torch.uint8, device=group.device) if error is None else \
        failure_message(error, size, group.device)
    return then(group.all_gather(mine, DOWN), lambda msgs: refused(msgs, head, failed))
