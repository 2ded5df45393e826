"""dqsgd's DDP hook under PyTorch Lightning: 2 CPU processes (gloo), a small MLP, synthetic data.

    pip install "dqsgd[lightning]"        # or: pip install lightning
    python examples/lightning_ddp.py [--out summary.json] [--steps 40]

The dqsgd lines are the two marked below: a ``HookState`` and ``dqsgd.ddp.hook`` handed to
Lightning's ``DDPStrategy``; Lightning starts the processes and registers the hook itself.

On CPU, Lightning (2.6) silently skips ``ddp_comm_hook``: it registers comm hooks on CUDA only, a
restriction of PyTorch 1.8 that gloo no longer has. :class:`CPUHookDDPStrategy` registers it there
too (it overrides a private Lightning method; on a GPU plain ``DDPStrategy`` is enough).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dqsgd.ddp

try:  # the `lightning` package, or the older `pytorch-lightning` one
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy


class CPUHookDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that also registers ``ddp_comm_hook`` on CPU (gloo)."""

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda" or self._ddp_comm_hook is None:
            super()._register_ddp_hooks()
        else:
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(n: int = 4096) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=torch.Generator().manual_seed(7))).argmax(dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="", help="write rank 0's summary here (JSON)")
    args = p.parse_args()
    torch.manual_seed(0)
    state = dqsgd.ddp.HookState(method="dqsgd", total_steps=args.steps, timeout=120.0)   # <- dqsgd
    strategy = CPUHookDDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                                  ddp_comm_hook=dqsgd.ddp.hook)                          # <- dqsgd
    model = Classifier()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data())
    if trainer.global_rank == 0:
        s = state.compression_stats()
        summary = {"first_loss": model.losses[0], "last_loss": sum(model.losses[-5:]) / 5, "steps": s.steps,
                   "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received, "ratio": s.ratio,
                   "total_ratio": s.total_ratio, "bits": state.current_bits()}
        print(json.dumps(summary))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
