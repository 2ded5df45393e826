"""Run one (method, seed) to completion with metrics, checkpoints and a progress bar."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from dqsgd.core.errors import Interrupted  # re-exported: raised by the training loop
from dqsgd.data import Dataset
from dqsgd.topology.agreement import RankDisagreement, agree  # noqa: F401  (RankDisagreement: re-exported)
from dqsgd.train.checkpoint import checkpoint_path, resume as resume_from, save_checkpoint
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.metrics import JsonlWriter, truncate_jsonl
from dqsgd.train.progress import eval_line, on_terminal, step_bar, write
from dqsgd.train.reader import RunDataError, finished
from dqsgd.train.rundir import (RunDirError, RunFinished, atomic_write, check_same_run, clear_run, data_fingerprint,
                                environment, holds_run, open_run, resolved_of_run, staged)
from dqsgd.train.runfiles import inside
from dqsgd.train.tensorboard import open_logger
from dqsgd.train.trainer import Trainer, record_of
from dqsgd.transport import Transport

class RunSummary(dict):
    """A finished run's summary: exactly what ``summary.json`` holds (JSON values only), and the
    model's final flat parameters as the attribute ``final_params`` (a tensor, never written as
    JSON). ``s["final_params"]`` reads the attribute too, as earlier versions returned it as a key."""

    def __init__(self, summary: dict[str, Any], final_params: torch.Tensor, already_finished: bool = False):
        super().__init__(summary)
        self.final_params = final_params
        self.already_finished = already_finished  # resumed a finished run: nothing was run or written

    def __missing__(self, key: str) -> Any:
        if key == "final_params":
            return self.final_params
        raise KeyError(key)


def run_dir(root: Path, label: str, seed: int) -> Path:
    """``root/label/seed<k>``, refused (:func:`dqsgd.train.runfiles.inside`) when ``label`` or
    ``seed<k>`` is a link: a run is never written outside its output directory ``root``."""
    return inside(root, root / label / f"seed{seed}")


TRAIN_ROOT = Path("runs") / "train"


def default_train_dir(exp_name: str, label: str, seed: int) -> Path:
    """``dqsgd train``'s default ``--out``: ``runs/train/<config>/<method>/seed<k>``, apart from the
    ``runs/<config>/...`` tree of ``dqsgd compare`` (a quick train never replaces a compared run);
    no component below ``runs/train`` may be a link."""
    return inside(TRAIN_ROOT, run_dir(TRAIN_ROOT / exp_name, label, seed))


def run_one(cfg: TrainConfig, entry: MethodEntry, data: Dataset, seed: int, out: Path | None,
            transport: Transport | None = None, resume: bool = False, progress: bool = True,
            device: str = "cpu", overwrite: bool = False) -> RunSummary:
    """Train ``entry`` with ``seed``; write ``metrics.jsonl``/``summary.json`` under ``out`` (if given);
    return the summary (:class:`RunSummary`: ``summary.json``'s contents and the final parameters).

    Every process keeps its checkpoints under ``out``; only rank 0 writes metrics and the summary, and
    holds the run directory's lock (:func:`dqsgd.train.rundir.open_run`). ``resume``: continue from
    the newest checkpoint step all ranks hold (a fresh start if none), only under the same resolved
    config. Before the first step all ranks agree on the config and data (:func:`agree_across_ranks`).
    """
    cfg = entry.train_config(cfg)  # the method's own Local SGD keys (resolved, compared on resume)
    tr = Trainer(cfg, entry, data, seed, transport, device)
    writes = out is not None and tr.transport.is_server and tr.transport.rank == 0
    mine = resolved_of_run(dataclasses.replace(cfg, topology=tr.topology), entry, seed, data_fingerprint(data))
    local = len(tr.transport.local_workers) == tr.transport.workers
    with contextlib.ExitStack() as held:
        error: Exception | None = None
        work, restart = out, False
        try:
            if writes:
                held.enter_context(open_run(out, resume, overwrite))
                if resume:
                    check_same_run(out, mine)
                restart = check_resumable(out, cfg.steps, entry.label, seed, overwrite) if resume else (
                    overwrite and holds_run(out))
                if restart and local:  # the old run's files stay until the new run finishes
                    work = held.enter_context(staged(out))
                elif restart:
                    clear_run(out)
        except RunFinished as e:  # left untouched; its final model from its last checkpoint, if it has one
            if not (local and any(out.glob("checkpoint*.pt"))):
                error = e
            else:
                resume_from(tr, out)
                return RunSummary(e.summary, tr.flat_params(), already_finished=True)
        except (RunDirError, OSError) as e:
            error = e
        agree_across_ranks(tr.transport, {**mine, **ranks_share(cfg, tr)}, error)
        return _train(cfg, entry, data, seed, work, tr, resume and not restart, progress, writes, mine)


def check_resumable(out: Path, steps: int, label: str, seed: int, overwrite: bool) -> bool:
    """Whether ``--resume out`` must restart the run (only when ``overwrite`` asks for it).

    Raises:
      RunFinished: the run already finished (left untouched), unless ``overwrite``.
      RunDirError: the run is unfinished but holds no checkpoint to continue from (its recorded
        steps would be lost), or its metrics were cut after it finished; unless ``overwrite``.
    """
    try:
        done = finished(out, steps, label, seed)
    except RunDataError as e:
        if overwrite:
            return True
        raise RunDirError(str(e)) from None
    if done is not None and not overwrite:
        raise RunFinished(out, done)
    has_records = (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0
    if done is None and not any(out.glob("checkpoint*.pt")) and has_records and not overwrite:
        raise RunDirError(f"{out} holds an unfinished run with no checkpoint to continue from (train.checkpoint_every "
                          f"= 0); restart it with --resume {out} --overwrite (its files are replaced only when the "
                          f"new run finishes)")
    return overwrite and (done is not None or not any(out.glob("checkpoint*.pt")))


def ranks_share(cfg: TrainConfig, tr: Trainer) -> dict[str, Any]:
    """What the ranks must share beyond the resolved config: ``train.checkpoint_every`` (which resume
    does not compare, but ranks that checkpoint at other steps hold no step in common) and a hash of the
    initial parameters (every rank builds the model from the seed; a difference would never be reconciled)."""
    from dqsgd.topology.agreement import tensor_digest

    return {"train.checkpoint_every": cfg.checkpoint_every, "params.initial": tensor_digest(tr.flat_params())}


def agree_across_ranks(transport: Transport, mine: dict[str, Any], error: Exception | None = None) -> None:
    """Compare the ranks' resolved configs (and the dqsgd version) with the fixed-size fingerprint of
    :func:`dqsgd.topology.agreement.agree`, and whether a rank refused the run directory; refuse on
    any difference, naming the keys, on every rank at once (nobody is left waiting)."""
    if len(transport.local_workers) == transport.workers:  # one process runs every worker
        if error is not None:
            raise error
        return
    from dqsgd import __version__

    agree({**mine, "dqsgd_version": __version__}, transport.all_gather_ints, transport.rank, error is not None,
          "the run directory")
    if error is not None:
        raise error


def _train(cfg: TrainConfig, entry: MethodEntry, data: Dataset, seed: int, out: Path | None, tr: Trainer,
           resume: bool, progress: bool, writes: bool, mine: dict[str, Any]) -> RunSummary:
    ck_path = checkpoint_path(out, tr.transport) if out is not None else None
    if resume and out is not None:
        resume_from(tr, out)
        if writes:
            truncate_jsonl(out / "metrics.jsonl", tr.next_step - 1)
    if writes:
        (out / "summary.json").unlink(missing_ok=True)  # written again at the end: present = finished
        atomic_write(out / "config.json", json.dumps(run_facts(cfg, entry, data, seed, tr, mine), indent=2))
    writer = JsonlWriter(out / "metrics.jsonl", append=resume) if writes else None
    board = open_logger(cfg, out, entry.label, seed, tr.ledger.up_bytes, tr.next_step if resume else None) \
        if writes and out is not None else None  # TensorBoard (train.tensorboard*), a mirror of the JSONL
    start = time.perf_counter()
    bar = step_bar(cfg.steps, tr.next_step, f"{entry.label} seed {seed}", progress)
    acc = loss = float("nan")
    local = len(tr.transport.local_workers) == tr.transport.workers
    try:
        with deferred_signals(local) as caught:
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
                saving = ck_path is not None and cfg.checkpoint_every > 0
                if saving and (tr.next_step % cfg.checkpoint_every == 0 or last or caught):
                    save_checkpoint(tr, ck_path)
                if caught and not last:
                    raise Interrupted(caught[0], tr.next_step, out, saving)
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
        atomic_write(out / "summary.json", json.dumps(summary, indent=2))
    return RunSummary(summary, tr.flat_params())


def _evaluate(tr: Trainer, bar: Any, label: str, progress: bool) -> tuple[float, float]:
    """``tr.evaluate()``, visible: the bar says so while it runs, then one line with its duration."""
    bar.set_postfix_str(f"evaluating at step {tr.next_step}...")
    t0 = time.perf_counter()
    acc, loss = tr.evaluate()
    if progress and on_terminal():  # in a log file: the run's one result line is enough
        write(eval_line(label, tr.next_step, acc, loss, time.perf_counter() - t0))
    return acc, loss


@contextlib.contextmanager
def deferred_signals(enabled: bool) -> Iterator[list[int]]:
    """SIGINT/SIGTERM only note themselves in the yielded list; the loop stops after the step in
    progress (a checkpoint taken mid-step would not resume exactly). A second signal stops at once."""
    caught: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def note(signum: int, frame: Any) -> None:
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def run_facts(cfg: TrainConfig, entry: MethodEntry, data: Dataset, seed: int, tr: Trainer,
              mine: dict[str, Any]) -> dict[str, Any]:
    """The static facts of a run (``config.json``); with ``metrics.jsonl`` they rebuild every table.

    ``resolved``: the keys compared on resume and by ``report``; ``environment``: where it ran (not compared).
    """
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
        "method_lr": entry.lr,
        "method_momentum": entry.momentum,
        "resolved": mine,
        "environment": environment(),
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
        "sim_time_s": tr.timer.elapsed,
        **{f"ledger_{k}": v for k, v in tr.ledger.summary().items()},
    }
