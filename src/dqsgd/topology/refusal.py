"""How a refusal reaches every rank: a message whose last byte is its status (0: fine; 1: the sender
refused a payload it received) and, when set, the error's type and text before it. Every exchange
(:mod:`dqsgd.topology.exchange`, the server's :mod:`dqsgd.topology.server`, the sketch, FSDP's
all-gather) writes and reads refusals with these functions, so every rank raises the same error type
with the same text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from dqsgd.topology import payloads as codec
from dqsgd.topology.group import DOWN, then

if TYPE_CHECKING:
    from dqsgd.topology.group import Group

__all__ = ["ROOM", "failure_message", "opened", "raise_if_refused", "refused", "relay"]

ROOM = 256  # bytes a status message keeps for a refusal's type and text, at least


def failure_message(err: Exception, size: int, device: torch.device) -> torch.Tensor:
    """A message of ``size`` bytes saying that its sender refused a payload: the error's type and text
    (cut to fit), then the status byte 1."""
    text = f"{type(err).__name__}: {err}".encode()[: size - 1]
    msg = codec.bytes_tensor(text, device, size)
    msg[-1] = 1
    return msg


def raise_if_refused(msg: torch.Tensor, head: str) -> None:
    """Raise the error ``msg`` carries (PayloadError or ProtocolError, its text after ``head``) if its
    status byte is set."""
    from dqsgd.codecs import PayloadError
    from dqsgd.method.pipeline import ProtocolError

    if int(msg[-1]):
        text = codec.tensor_bytes(msg[:-1]).rstrip(b"\0").decode(errors="replace")
        kind, _, text = text.partition(": ")
        raise (ProtocolError if kind == "ProtocolError" else PayloadError)(f"{head}: {text}")


def refused(msgs: Sequence[torch.Tensor], head: Callable[[int], str]) -> None:
    """Raise the error of the first message (rank order) whose status is set, after ``head(its rank)``."""
    for j, m in enumerate(msgs):
        raise_if_refused(m, head(j))


def opened(msg: torch.Tensor, who: str) -> bytes:
    """A message's bytes before its status byte; where its sender (``who``) refused a payload, that
    error, raised with its type and text."""
    raise_if_refused(msg, f"{who} refused a payload")
    return codec.tensor_bytes(msg[:-1])


def relay(group: Group, error: Exception | None, head: Callable[[int], str]) -> Any:
    """One all-gather of every rank's status message (:func:`failure_message` of ``error``, or status 0):
    a future that fails with the first refusing rank's error (:func:`refused`) on every rank."""
    size = ROOM + 1
    mine = torch.zeros(size, dtype=torch.uint8, device=group.device) if error is None else \
        failure_message(error, size, group.device)
    return then(group.all_gather(mine, DOWN), lambda msgs: refused(msgs, head))
