"""An asynchronous all-gather of messages of different lengths (the hook's coded downlink).

The lengths go first (one all-gather of W integers), then the messages, each padded to the
longest, in a second all-gather — what the trainer's torch transports do for the same exchange
(:meth:`dqsgd.transport.torch_dist.TorchShardedTransport.share`), so the hook's bytes on the wire
are the trainer's ledger's. Both collectives are issued without blocking: the second from the
first's completion callback. Every rank must issue the two in the same order relative to its
other collectives on ``group``: the returned ``issued`` future completes once the second is issued
(the hook starts the next bucket's downlink only then).
"""

# No `from __future__ import annotations`: this module sits beside the DDP hook, whose annotations
# DDP reads at run time; kept alike.
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

Gathered = Tuple[List[torch.Tensor], List[int]]


def all_gather_varlen(msg: torch.Tensor, group: dist.ProcessGroup, world: int,
                      on_sizes: Callable[[List[int]], None]
                      ) -> Tuple["torch.futures.Future[Gathered]", "torch.futures.Future[None]"]:
    """All-gather ``msg`` (a ``uint8`` tensor) from every rank of ``group``: a future of (the W
    messages, each padded to the longest, in rank order; their lengths), and the future that
    completes once the messages' collective is issued. ``on_sizes(lengths)`` runs before that
    collective is issued (the caller counts its traffic there); an exception it or the collectives
    raise fails both futures' consumer, the first future."""
    size = torch.tensor([msg.numel()], dtype=torch.int64, device=msg.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    first = dist.all_gather(sizes, size, group=group, async_op=True).get_future()
    result: "torch.futures.Future[Gathered]" = torch.futures.Future()
    issued: "torch.futures.Future[None]" = torch.futures.Future()

    def send(fut: torch.futures.Future) -> None:
        try:
            fut.value()
            lengths = [int(n) for n in torch.cat(sizes).tolist()]
            on_sizes(lengths)
            top = max(lengths)
            padded = msg if msg.numel() == top else torch.cat(
                [msg, torch.zeros(top - msg.numel(), dtype=torch.uint8, device=msg.device)])
            gathered = [torch.empty(top, dtype=torch.uint8, device=msg.device) for _ in range(world)]
            work = dist.all_gather(gathered, padded, group=group, async_op=True)
        except Exception as e:  # noqa: BLE001 - handed to the consumer of the result
            issued.set_result(None)
            result.set_exception(e)
            return
        issued.set_result(None)

        def done(f: torch.futures.Future) -> None:
            try:
                f.value()
                result.set_result((gathered, lengths))
            except Exception as e:  # noqa: BLE001 - handed to the consumer of the result
                result.set_exception(e)

        work.get_future().then(done)

    first.then(send)
    return result, issued
