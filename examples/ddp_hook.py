"""DQSGD inside your own DDP training: two gloo processes, a tiny MLP, synthetic data.

    python examples/ddp_hook.py                 # starts 2 processes itself on 127.0.0.1
    torchrun --nproc-per-node 2 examples/ddp_hook.py

The only dqsgd lines are the two marked below; the rest is ordinary DistributedDataParallel.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dqsgd.ddp

STEPS, BATCH = 60, 64


def train(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts it)
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    model = DDP(net)
    state = dqsgd.ddp.HookState(method="dqsgd", process_group=None, total_steps=STEPS)  # <- dqsgd
    model.register_comm_hook(state, dqsgd.ddp.hook)                                    # <- dqsgd
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of a synthetic task
    w_true = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
    for step in range(STEPS):
        x = torch.randn(BATCH, 20, generator=data)
        y = (x @ w_true).argmax(dim=1)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # the hook quantizes, exchanges and averages each gradient bucket here
        opt.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}  bits per bucket {state.current_bits()}")
    if rank == 0:
        s = state.compression_stats()
        print(f"sent {s.bytes_sent} B instead of {s.fp32_bytes} B of fp32: measured ratio {s.ratio:.2f} "
              f"(fp32 bytes / bytes sent), mean {s.mean_bits:.2f} bits per coordinate over {s.steps} steps; "
              f"sent + received {s.bytes_sent + s.bytes_received} B against {s.allreduce_bytes} B for a ring "
              f"all-reduce: {s.total_ratio:.2f}x less traffic")


def _spawned(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        train(rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        train(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(2, port), nprocs=2)
