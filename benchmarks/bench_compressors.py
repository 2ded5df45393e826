"""``dqsgd bench compressors``: dqsgd's methods against PyTorch's DDP compression hooks on one real gradient.

Run as ``dqsgd bench compressors [options]`` from a source checkout, or as
``python benchmarks/bench_compressors.py [--out FILE] [options]`` (see ``--help``). The table is printed
and the JSON goes to ``--out``. It lives here, not in the package, because it calls PyTorch's hooks on
a one-process gloo group and their private quantization backend; the shared helpers come from
:mod:`dqsgd.cli.bench.common`.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable

import torch

from dqsgd.cli.bench.common import best_of, print_table, real_gradient, set_threads, write_result
from dqsgd.kernels import HashRNG


class _Bucket:
    """The part of ``dist.GradBucket`` the PyTorch hooks use: one flat buffer of all gradients."""

    def __init__(self, flat: torch.Tensor, shapes: list[torch.Size]):
        self._buf, self._shapes = flat.clone(), shapes

    def buffer(self) -> torch.Tensor:
        return self._buf

    def set_buffer(self, t: torch.Tensor) -> None:
        self._buf = t

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        out, off = [], 0
        for s in self._shapes:
            k = math.prod(s)
            out.append(self._buf[off : off + k].view(s))
            off += k
        return out


def _pertensor(t: torch.Tensor) -> torch.Tensor:
    """quantization_pertensor_hook's math: MinMaxObserver qparams, uint8 round trip."""
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh

    obs = torch.ao.quantization.MinMaxObserver()
    obs(t)
    scale, zero = obs.calculate_qparams()
    return qh._dequantize_per_tensor_backend(qh._quantize_per_tensor_backend(t, scale, zero), scale, zero)


_Case = tuple[Callable[[], torch.Tensor], Callable[[], int]]  # (encode+decode once → Q(g), bytes sent)


def _torch_hooks(g: torch.Tensor, shapes: list[torch.Size]) -> dict[str, _Case]:
    """PyTorch's compression hooks on a 1-process gloo group: name → (run, bytes sent)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pg = dist.group.WORLD
    hooks: dict[str, _Case] = {
        "torch fp16_compress_hook": (lambda: default_hooks.fp16_compress_hook(pg, _Bucket(g, shapes)).wait(),
                                     lambda: 2 * g.numel()),  # fp16 per coordinate (allreduce payload)
        # The hook itself fails here (IndexError in quantize_and_allgather on the all_gather future's
        # value, torch 2.13, 1-process gloo): its own quantize/dequantize functions, applied directly.
        "torch quantization_pertensor (hook math)": (lambda: _pertensor(g), lambda: g.numel() + 8),
    }
    for rank in (1, 4):
        state = {}

        def run(rank: int = rank, state: dict = state) -> torch.Tensor:
            st = powerSGD_hook.PowerSGDState(pg, matrix_approximation_rank=rank, start_powerSGD_iter=0,
                                             use_error_feedback=False, warm_start=False)
            state["st"] = st
            return powerSGD_hook.powerSGD_hook(st, _Bucket(g, shapes)).wait()

        hooks[f"torch powerSGD rank {rank}"] = (run, lambda state=state: 4 * state["st"].total_numel_after_compression)
    return hooks


def bench_compressors(args: argparse.Namespace) -> dict[str, Any]:
    from dqsgd.method.config import method_config
    from dqsgd.method.pipeline import Method
    from dqsgd.topology.bucket import BucketProtocol
    from dqsgd.topology.payloads import bytes_tensor

    set_threads(args.threads)
    g, shapes = real_gradient(args.model, args.dataset, args.batch)
    n, norm = g.numel(), float(g.norm())
    sizes = [math.prod(s) for s in shapes]
    cases: dict[str, _Case] = {}
    specs = [("sgd", {}), ("qsgd-2bit", {}), ("qsgd-4bit", {}), ("qsgd-8bit", {}), ("dqsgd", {}), ("terngrad", {}),
             ("signsgd", {}), ("qsgd-4bit", {"kernel": "fused"}), ("dqsgd", {"kernel": "fused"})]
    for name, over in specs:
        m = Method(method_config(name, **over), n, 100, sizes)
        bits = m.init_state(1).bits
        gen, rng = torch.Generator().manual_seed(0), HashRNG(0, 0, 0)
        scalers = m.local_scalers(g) if m.shares_scalers else None
        last: dict[str, bytes] = {}
        proto = BucketProtocol(m.config, n, sizes, topology="ps", workers=1, seed=0, total_steps=100, method=m)

        def run(m: Method = m, bits: int = bits, gen=gen, rng=rng, scalers=scalers, last=last,
                proto: BucketProtocol = proto) -> torch.Tensor:
            last["p"] = m.encode(g, bits, None if m.fused else gen, None, scalers, hash_rng=rng if m.fused else None)[0]
            return proto.reduce(0, [bytes_tensor(last["p"])], bits)

        label = f"dqsgd:{name}" + (" fused" if over else "")
        label += f" ({bits} bits)" if m.config.scheme == "uniform" else ""
        cases[label] = (run, lambda last=last: len(last["p"]))
    cases.update(_torch_hooks(g, shapes))
    rows = []
    for label, (run, nbytes) in cases.items():
        approx = run()
        t = best_of({"x": run}, args.repeats)["x"]
        rows.append({"compressor": label, "bytes": nbytes(), "ratio": 4 * n / nbytes(),
                     "rel_error": float((approx.reshape(-1) - g).norm()) / norm, "encdec_ms": 1e3 * t})
    print(f"compressors on one {args.model}/{args.dataset} gradient ({n} coordinates, batch {args.batch}); "
          "ratio = fp32 bytes / bytes sent; encode+decode includes a 1-process collective for the torch hooks")
    print_table(rows, ["compressor", "bytes", "ratio", "rel_error", "encdec_ms"])
    result = {"n": n, "model": args.model, "dataset": args.dataset, "rows": rows}
    write_result(result, args.out)
    return result



if __name__ == "__main__":
    from dqsgd.cli.bench.parser import parse_args

    bench_compressors(parse_args(["bench", "compressors", *sys.argv[1:]]))
