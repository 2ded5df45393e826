"""Bytes per rank per step of FSDP2's parameter all-gather: fp32 (FSDP's own) against dqsgd's quantized
all-gather at 8 and 4 bits, measured as handed to the process group (gloo, CPU, no shaping).

    python benchmarks/fsdp_param_bytes.py [--world 4] [--sizes 1024,1024,1024,1024] [--steps 2] [--bits 32,8,4]

The model is ``dqsgd bench fsdp``'s MLP (each Linear its own FSDP unit, 3.1M parameters at the
default sizes); the gradient reduce-scatter stays FSDP's own (``compress(..., gradients=False)``), so
only the parameter leg differs. Per step: payload bytes one rank sent (every all-gather of the forward
and the backward), the side bytes (the frames' headers), and FSDP's fp32 all-gather for the same
calls, (W−1)·4·n per call.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def rank_main(rank: int, world: int, sizes: list[int], steps: int, bits: int, block: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dqsgd.fsdp as dfsdp

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = dfsdp.FSDPState("sgd", param_bits=bits, param_block=block, timeout=120)
    dfsdp.compress(model, state, gradients=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        model(torch.randn(8, sizes[0], generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    s = state.stats()
    return {"params": sum(p.numel() for p in model.parameters()), "sent": s["param_bytes_sent"] / steps,
            "side": s["param_side_bytes"] / steps, "fp32": s["fp32_ag_bytes"] / steps,
            "calls": s["param_calls"] / steps}


def main() -> None:
    from dqsgd.cli.launch import spawn_local

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes", default="1024,1024,1024,1024")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--bits", default="32,8,4", help="all-gather widths to run, comma-separated (32: fp32)")
    a = ap.parse_args()
    sizes = [int(v) for v in a.sizes.split(",")]
    print(f"W = {a.world}, MLP {sizes}, {a.steps} steps, blocks of {a.block}; bytes per rank per step")
    print(f"{'all-gather':>12} {'payload':>12} {'side':>8} {'fp32':>12} {'fp32/sent':>10}")
    for bits in (int(b) for b in a.bits.split(",")):
        results = spawn_local(rank_main, a.world, (sizes, a.steps, bits, a.block), timeout=120, deadline=600)
        bad = [r.describe() for r in results if not r.ok]
        if bad:
            raise SystemExit(f"a rank failed: {bad}")
        v = results[0].value
        fp32 = v["fp32"]  # FSDP's own all-gather of the same calls
        name = "fp32 (32)" if bits == 32 else f"{bits}-bit"
        total = v["sent"] + v["side"]
        print(f"{name:>12} {v['sent']:>12.0f} {v['side']:>8.0f} {fp32:>12.0f} {fp32 / total:>10.2f}")
    print(f"({v['params']} parameters, {v['calls']:.0f} all-gathers per step; FSDP's own fp32 all-gather "
          "sends the fp32 column)")


if __name__ == "__main__":
    main()
