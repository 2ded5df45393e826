"""Run one (method, seed) to completion with metrics, checkpoints and a progress bar."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from dqsgd.data import Dataset
from dqsgd.train.checkpoint import checkpoint_path, resume as resume_from, save_checkpoint
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.metrics import JsonlWriter, truncate_jsonl
from dqsgd.train.progress import eval_line, step_bar, write
from dqsgd.train.tensorboard import open_logger
from dqsgd.train.trainer import Trainer, record_of
from dqsgd.transport import Transport

def run_dir(root: Path, label: str, seed: int) -> Path:
    return root / label / f"seed{seed}"


def run_one(cfg: TrainConfig, entry: MethodEntry, data: Dataset, seed: int, out: Path | None,
            transport: Transport | None = None, resume: bool = False, progress: bool = True,
            device: str = "cpu") -> dict[str, Any]:
    """Train ``entry`` with ``seed``; write ``metrics.jsonl``/``summary.json`` under ``out`` (if given).

    Every process keeps its checkpoints under ``out``; only rank 0 writes metrics and the summary.
    ``resume``: continue from the newest checkpoint step all ranks hold (a fresh start if none).
    """
    tr = Trainer(cfg, entry, data, seed, transport, device)
    writes = out is not None and tr.transport.is_server and tr.transport.rank == 0
    ck_path = checkpoint_path(out, tr.transport) if out is not None else None
    if resume and out is not None:
        resume_from(tr, out)
        if writes:
            truncate_jsonl(out / "metrics.jsonl", tr.next_step - 1)
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").unlink(missing_ok=True)  # written again at the end: present = finished
        (out / "config.json").write_text(json.dumps(run_facts(cfg, entry, data, seed, tr), indent=2))
    writer = JsonlWriter(out / "metrics.jsonl", append=resume) if writes else None
    board = open_logger(cfg, out, entry.label, seed, tr.ledger.up_bytes, tr.next_step if resume else None) \
        if writes and out is not None else None  # TensorBoard (train.tensorboard*), a mirror of the JSONL
    start = time.perf_counter()
    bar = step_bar(cfg.steps, tr.next_step, f"{entry.label} seed {seed}", progress)
    acc = loss = float("nan")
    try:
        while tr.next_step < cfg.steps:
            res = tr.step()
            rec = record_of(res, tr.ledger)
            last = tr.next_step == cfg.steps
            # Only rank 0 evaluates: every rank holds the same model, and rank 0 writes the metrics.
            if (last or tr.next_step % cfg.eval_every == 0) and tr.transport.rank == 0:
                acc, loss = _evaluate(tr, bar, entry.label, progress)
                rec.update(test_acc=acc, test_loss=loss)
                bar.set_postfix_str(f"acc={acc:.4f}, bits={res.bits}")
            if writer is not None:
                writer.write(rec)
            if board is not None:
                board.write(rec)
            if ck_path is not None and cfg.checkpoint_every and (tr.next_step % cfg.checkpoint_every == 0 or last):
                save_checkpoint(tr, ck_path)
            bar.update(1)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        if board is not None:
            board.close()
    if math.isnan(acc) and tr.transport.rank == 0:  # resumed at the very end: no step ran, evaluate once
        acc, loss = _evaluate(tr, bar, entry.label, progress)
    summary = summarize(cfg, entry, data, seed, tr, acc, loss, time.perf_counter() - start)
    if writes:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    summary["final_params"] = tr.flat_params()
    return summary


def _evaluate(tr: Trainer, bar: Any, label: str, progress: bool) -> tuple[float, float]:
    """``tr.evaluate()``, visible: the bar says so while it runs, then one line with its duration."""
    bar.set_postfix_str(f"evaluating at step {tr.next_step}...")
    t0 = time.perf_counter()
    acc, loss = tr.evaluate()
    if progress:
        write(eval_line(label, tr.next_step, acc, loss, time.perf_counter() - t0))
    return acc, loss


def run_facts(cfg: TrainConfig, entry: MethodEntry, data: Dataset, seed: int, tr: Trainer) -> dict[str, Any]:
    """The static facts of a run (``config.json``); with ``metrics.jsonl`` they rebuild every table."""
    return {
        "method": entry.label,
        "method_config": dataclasses.asdict(entry.config),
        "train_config": dataclasses.asdict(cfg),
        "dataset": data.name,
        "stand_in_for": data.stand_in_for,
        "seed": seed,
        "numel": tr.numel,
        "workers": cfg.workers,
        "lr": tr.lr,
        "budget_bits": tr.ledger.budget_bits,
    }


def summarize(cfg: TrainConfig, entry: MethodEntry, data: Dataset, seed: int, tr: Trainer,
              acc: float, loss: float, wall: float) -> dict[str, Any]:
    return {
        "method": entry.label,
        "method_config": dataclasses.asdict(entry.config),
        "dataset": data.name,
        "stand_in_for": data.stand_in_for,
        "model": cfg.model,
        "workers": cfg.workers,
        "steps": cfg.steps,
        "seed": seed,
        "numel": tr.numel,
        "lr": tr.lr,
        "test_acc": acc,
        "test_loss": loss,
        "skipped_steps": tr.skipped,
        "wall_s": wall,
        **{f"ledger_{k}": v for k, v in tr.ledger.summary().items()},
    }
