"""Start distributed training: under torchrun, or W local processes on 127.0.0.1.

Single host, W = 4 processes (gloo on CPU; NCCL with one GPU per process when CUDA is there)::

    torchrun --nproc-per-node 4 -m dqsgd train --transport torch --topology ps \\
        --config table1-mnist --method dqsgd --set train.workers=4

(add ``--standalone`` to let torchrun pick a free port instead of 29500).

Two hosts with 4 processes each (W = 8; run the same command on both, HOST:PORT reachable from both)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-id dqsgd-run1 -m dqsgd train --transport torch --topology ps \\
        --config table1-mnist --method dqsgd --set train.workers=8

Without torchrun, ``dqsgd train --transport torch --workers 4 --set train.workers=4 ...`` starts the
4 processes itself on 127.0.0.1 (a free port; the rendezvous store lives in the launching process,
so it outlives any worker and carries their error messages). ``--topology`` selects the collective:
``sharded`` (the default: every rank serves 1/W of the vector, quantized both ways), ``ps`` (rank 0
serves everything) or ``allgather`` (peers); ``--timeout S`` is the limit of every collective. ``train.workers`` must equal the
number of processes (the world size). Only rank 0 writes ``metrics.jsonl``/``summary.json``.
Set GLOO_SOCKET_IFNAME (torch's variable) if gloo picks the wrong network interface on a multi-host run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dqsgd.codecs import PayloadError
from dqsgd.core.cpus import available_cpus
from dqsgd.core.ranges import check_timeout
from dqsgd.core.timeouts import TRAIN_COLLECTIVE_S
from dqsgd.method.pipeline import ProtocolError
from dqsgd.quantizers import NonFiniteGradientError
from dqsgd.train.checkpoint import CheckpointError
from dqsgd.topology.registry import run_topology
from dqsgd.train.config import ConfigError, ExperimentConfig, MethodEntry
from dqsgd.train.rundir import RunDirError, RunFinished
from dqsgd.train.slownodes import check_backup_keys
from dqsgd.transport.backup import BackupPSTransport
from dqsgd.transport.torch_dist import RankDisagreement, TransportError, make_transport

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
# Errors whose one-line message says everything; anything else also prints its traceback.
CLEAR_ERRORS = (TransportError, RankDisagreement, PayloadError, ProtocolError, ConfigError, CheckpointError, RunDirError,
                NonFiniteGradientError)


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


@dataclass(frozen=True)
class RankResult:
    """What one locally started rank left: exit code, return value (if it succeeded), error text."""

    rank: int
    exitcode: int | None          # negative: killed by that signal
    value: Any = None
    error: str | None = None
    stopped_by_launcher: bool = False  # still running when the launcher gave up on the run

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok"
        if self.error:
            return f"rank {self.rank}: {self.error}"
        if self.stopped_by_launcher:
            return f"rank {self.rank}: hung (did not stop on its own after the others failed or the deadline); killed"
        if self.exitcode is None:
            return f"rank {self.rank}: did not exit"
        if self.exitcode < 0:
            return f"rank {self.rank}: died from signal {signal.Signals(-self.exitcode).name}"
        return f"rank {self.rank}: exited with code {self.exitcode}"


# --- local processes ------------------------------------------------------------------------------
_START_METHOD = "spawn"


def use_forkserver(preload: list[str]) -> None:
    """Start the processes of later :func:`spawn_local` calls by forking them from one server process
    that imported ``preload`` once (multiprocessing's forkserver), instead of a fresh interpreter each.

    For callers that start many short process groups in one process (a test suite): each fresh
    interpreter spends seconds importing torch before it joins the group. The ranks run the same
    code; what differs is inherited from the server, not from the caller: its environment and working
    directory as of the first call, and one string-hash seed for all ranks. A rank then stops with
    the server, which exits with this process. ``dqsgd train`` keeps fresh interpreters.
    """
    global _START_METHOD
    mp.set_forkserver_preload(preload)
    _START_METHOD = "forkserver"


def spawn_local(fn: Callable[..., Any], world_size: int, args: tuple = (), *, backend: str = "gloo",
                timeout: float = TRAIN_COLLECTIVE_S, threads: int = 1, deadline: float | None = None) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes joined in a process group.

    The store is hosted here (127.0.0.1, a free port), so it survives a dead rank. Every collective
    has ``timeout`` seconds. Once a rank fails, the others get ``timeout`` + 10 s to stop on their
    own before they are killed; ``deadline`` (seconds) bounds the whole run. ``threads``: torch
    intra-op threads per process (1 keeps W processes from fighting over the cores).
    """
    if world_size < 1:
        raise ValueError(f"need at least one process, got {world_size}")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    tmp = Path(tempfile.mkdtemp(prefix="dqsgd-ranks-"))
    ctx = mp.get_context(_START_METHOD)
    launcher = os.getpid() if _START_METHOD == "spawn" else 0  # 0: the forkserver, this rank's parent
    procs = [ctx.Process(target=_bootstrap, name=f"dqsgd-rank{r}",
                         args=(r, world_size, store.port, backend, timeout, threads, fn, args, str(tmp), launcher))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        stopped = _wait(procs, timeout + 10.0, deadline)
        return [_result(r, p, tmp, r in stopped) for r, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        del store


def _wait(procs: list, grace: float, deadline: float | None) -> set[int]:
    """Wait for every process; past the grace/deadline, stop the rest. Returns the ranks it stopped."""
    start, failed_at, stopped = time.monotonic(), None, set()
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if (failed_at is not None and now - failed_at > grace) or (deadline is not None and now - start > deadline):
            stopped = {r for r, p in enumerate(procs) if p.is_alive()}
            for p in procs:
                if p.is_alive():
                    p.terminate()
            time.sleep(1.0)
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=5.0)
    return stopped


def _result(rank: int, proc, tmp: Path, stopped: bool) -> RankResult:
    code = proc.exitcode
    if code == 0 and (tmp / f"{rank}.ok").exists():
        return RankResult(rank, 0, pickle.loads((tmp / f"{rank}.ok").read_bytes()))
    err = tmp / f"{rank}.err"
    return RankResult(rank, code if code != 0 else 1, None, err.read_text() if err.exists() else None, stopped)


def _bootstrap(rank: int, world: int, port: int, backend: str, timeout: float, threads: int,
               fn: Callable[..., Any], args: tuple, tmp: str, launcher: int | None = None) -> None:
    """Child process: join the group, run ``fn``, leave the result or the error in ``tmp``.

    ``launcher``: the pid to die with (0: the parent, a forkserver; None: none)."""
    if launcher == 0:
        launcher = os.getppid()
    stop_watching = exit_with_launcher(launcher) if launcher is not None else (lambda: None)
    torch.set_num_threads(threads)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torch's variable: keep gloo on loopback
    try:
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=td)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td)
        value = fn(rank, world, *args)
        Path(tmp, f"{rank}.ok").write_bytes(pickle.dumps(value))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 — report anything, then leave without running destructors
        _fail(rank, e, Path(tmp, f"{rank}.err"))
    stop_watching()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk and the group destroyed: leave without the interpreter's teardown, in which
    # gloo's C++ threads could abort the process ("terminate called ...") while a slower peer still works.
    os._exit(0)


def exit_with_launcher(launcher: int, poll: float = 0.5) -> Callable[[], None]:
    """Make this rank die with the process that launched it (a SIGKILLed launcher cannot clean up).

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the kernel to kill us when our parent exits.
    Everywhere (and for the race where the parent died before the prctl): a daemon thread that
    exits the process once the parent pid is no longer ``launcher`` (we were re-parented).
    Returns the function that stops and joins the watchdog.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # the watchdog below still works
    if os.getppid() != launcher:
        os._exit(1)

    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll):
            if os.getppid() != launcher:
                print("dqsgd: error: the launching process died; this rank stops", file=sys.stderr, flush=True)
                os._exit(1)

    thread = threading.Thread(target=watch, name="dqsgd-launcher-watchdog", daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join()

    return stop


def _fail(rank: int, e: BaseException, err_file: Path | None) -> None:
    """Print one clear line (and the traceback if it is not one of ours), then exit at once.

    ``os._exit``: after a failed collective, the process group's destructor may abort the process.
    """
    line = f"{type(e).__name__}: {e}"
    if not line.startswith(f"{type(e).__name__}: rank {rank}"):
        line = f"{type(e).__name__}: rank {rank}: {e}"
    if not isinstance(e, CLEAR_ERRORS):
        traceback.print_exc()
    print(f"dqsgd: error: {line}", file=sys.stderr, flush=True)
    if err_file is not None:
        with_err = err_file.with_suffix(".tmp")
        with_err.write_text(line)
        os.replace(with_err, err_file)
    sys.stdout.flush()
    os._exit(1)


# --- `dqsgd train --transport torch` -------------------------------------------------------------
@dataclass(frozen=True)
class _RankJob:
    exp: ExperimentConfig
    entry: MethodEntry
    seed: int
    topology: str
    out: str | None
    progress: bool
    resume: bool = False
    overwrite: bool = False
    timeout: float = TRAIN_COLLECTIVE_S  # --timeout: every wait of the run (the backup workers' transport too)


def job_transport(job: _RankJob, device: str) -> Any:
    """The rank's transport: the topology's, or with backup workers the ps transport that aggregates the
    first arrivals, whose waits for a silent worker last ``--timeout`` (``job.timeout``)."""
    backup = job.exp.train.backup_workers
    if not backup:
        return make_transport(job.topology, device=device)
    return BackupPSTransport(backup, timeout=job.timeout)


def run_rank(rank: int, world: int, job: _RankJob) -> dict[str, Any]:
    """One rank of a run in an initialized process group: its Trainer, its transport, rank 0 writes
    metrics; every rank keeps its own checkpoints in the run directory (``job.resume``: continue from them)."""
    from dqsgd.experiments.compare import load_data_for
    from dqsgd.train.runner import run_one

    cuda = str(dist.get_backend()) == "nccl"
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    transport = job_transport(job, device)
    out = Path(job.out) if job.out is not None else None
    with transport.guard():
        summary = run_one(job.exp.train, job.entry, load_data_for(job.exp), job.seed, out, transport=transport,
                          resume=job.resume, progress=job.progress and rank == 0, device=device,
                          overwrite=job.overwrite and not job.resume)
    return dict(summary)  # the JSON values only: the final parameters stay in this process


def _print_summary(s: dict[str, Any], out: str | None, topology: str) -> None:
    from dqsgd.train.progress import result_line

    print(f"{result_line(s)}; W = {s['workers']} processes, {topology} topology; metrics in {out}")


def train_distributed(exp: ExperimentConfig, entry: MethodEntry, seed: int, args: argparse.Namespace) -> int:
    """``dqsgd train --transport torch``: one rank here (torchrun) or W local processes.

    Restarts: under ``torchrun --max-restarts N`` a restarted rank (``TORCHELASTIC_RESTART_COUNT`` > 0)
    resumes from the run directory's checkpoints; without torchrun, ``--max-restarts N`` restarts the
    W local processes the same way. ``--resume RUN_DIR`` resumes explicitly.
    """
    if resumed_finished(exp, entry, seed, args):
        return 0
    exp, out, restarts, world = check_distributed(exp, entry, seed, args)
    timeout = float(args.timeout)
    job = _RankJob(exp, entry, seed, run_topology(exp.train.topology, processes=True), out, not args.quiet, bool(args.resume),
                   bool(getattr(args, "overwrite", False)), timeout)
    if under_torchrun():
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restarted and not exp.train.checkpoint_every and os.environ.get("RANK") == "0":
            print(f"dqsgd: torchrun restart {restarted}: train.checkpoint_every = 0, so the run starts over",
                  file=sys.stderr)
        return _torchrun_rank(dataclasses.replace(job, resume=job.resume or restarted > 0), timeout, args)
    threads = max(1, available_cpus() // world)  # the CPUs this process may use (taskset), shared by the ranks
    for attempt in range(restarts + 1):
        results = spawn_local(run_rank, world, (job,), timeout=timeout, threads=threads)
        lost = [r for r in results if not r.ok]
        if results[0].ok and len(lost) <= exp.train.backup_workers:  # the server finished: so did the run
            for r in lost:
                print(f"dqsgd: {r.describe()}; the server went on without it (backup workers)", file=sys.stderr)
            _print_summary(results[0].value, out, job.topology)
            return 0
        print("dqsgd: error: distributed run failed:\n  " + "\n  ".join(r.describe() for r in results), file=sys.stderr)
        if attempt < restarts:
            print(f"dqsgd: restarting all {world} processes from the last checkpoints in {out} "
                  f"(restart {attempt + 1} of {restarts})", file=sys.stderr)
            job = dataclasses.replace(job, resume=True)  # (the next attempt continues this run: no overwrite)
    return 1


def resumed_finished(exp: ExperimentConfig, entry: MethodEntry, seed: int, args: argparse.Namespace) -> bool:
    """``--resume`` of a run that already finished: reported as the simulation reports it (``dqsgd:
    RUN already finished (...); nothing to do (left untouched)``, exit 0) before any process starts.
    Every other state of the directory is left to the run itself (which says why it refuses)."""
    if not args.resume or getattr(args, "overwrite", False):
        return False
    from dqsgd.train.runner import check_resumable

    try:
        check_resumable(Path(args.resume), exp.train.steps, entry.label, seed, False)
    except RunFinished as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun: one line, from rank 0
            print(f"dqsgd: {e}")
        return True
    except RunDirError:
        return False
    return False


def check_distributed(exp: ExperimentConfig, entry: MethodEntry, seed: int,
                      args: argparse.Namespace) -> tuple[ExperimentConfig, str, int, int]:
    """The checks of ``dqsgd train --transport torch`` before any process starts (also its
    ``--dry-run``): (experiment with train.workers set, output directory, restarts, world size)."""
    from dqsgd.train.runner import default_train_dir

    out = str(args.resume or args.out or default_train_dir(exp.train.name, entry.label, seed))
    restarts = int(getattr(args, "max_restarts", 0) or 0)
    if restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {restarts}")
    try:
        check_timeout("--timeout", args.timeout, none_ok=False)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if (restarts or args.resume) and not exp.train.checkpoint_every:
        raise ConfigError("restarting needs checkpoints: add --set train.checkpoint_every=K (steps)")
    if exp.train.backup_workers:
        check_backup_keys(dataclasses.replace(exp.train, topology=run_topology(exp.train.topology, processes=True)))
    if not under_torchrun():
        world = args.workers if args.workers is not None else exp.train.workers
        _check_world(exp, world, "--workers")
        return exp, out, restarts, world
    if restarts:
        raise ConfigError("under torchrun, give --max-restarts to torchrun itself (it restarts the ranks)")
    exp = workers_from_world_size(exp, getattr(args, "set", None) or [])
    world = int(os.environ["WORLD_SIZE"])
    _check_world(exp, world, "torchrun (WORLD_SIZE)")
    return exp, out, restarts, world


def workers_from_world_size(exp: ExperimentConfig, overrides: list[str]) -> ExperimentConfig:
    """Under torchrun, ``train.workers`` is WORLD_SIZE (one worker per process) unless the command line
    sets it (``--set train.workers=W``); an explicit value that disagrees is refused by :func:`_check_world`.
    The config file's value describes the simulation, so it gives way (rank 0 says so when they differ)."""
    if any(o.split("=", 1)[0].strip() == "train.workers" for o in overrides):
        return exp
    world = int(os.environ["WORLD_SIZE"])
    if world != exp.train.workers and os.environ.get("RANK") == "0":
        print(f"dqsgd: train.workers = {world} from torchrun's WORLD_SIZE (the config says {exp.train.workers})",
              file=sys.stderr)
    return dataclasses.replace(exp, train=dataclasses.replace(exp.train, workers=world))


def _check_world(exp: ExperimentConfig, world: int, source: str) -> None:
    if world != exp.train.workers:
        raise ConfigError(f"train.workers = {exp.train.workers} but {source} gives {world} processes; one worker "
                          f"runs per process, so add --set train.workers={world} (or start {exp.train.workers} processes)")


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's rendezvous store, under a prefix of its own per restart.

    After ``--max-restarts`` restarts, torchrun's agent may hand the new workers the store of the
    previous attempt; its keys (the dead processes' gloo addresses) would make the new group try to
    connect to them ("Connection refused"). A per-attempt prefix keeps every attempt's keys apart.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_hosts and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"dqsgd/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _torchrun_rank(job: _RankJob, timeout: float, args: argparse.Namespace) -> NoReturn:
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    td = datetime.timedelta(seconds=timeout)
    dist.init_process_group("nccl" if cuda else "gloo", store=_attempt_store(rank, world, td), rank=rank,
                            world_size=world, timeout=td)
    try:
        summary = run_rank(rank, world, job)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        _fail(rank, e, None)
    if rank == 0:
        _print_summary(summary, job.out, job.topology)
    sys.stdout.flush()
    sys.stderr.flush()
    # As for spawned ranks: the run is on disk and the group destroyed, so leave without the
    # interpreter's teardown, where gloo's C++ threads can abort a finished rank ("terminate called
    # without an active exception", seen about once in five torchrun runs).
    os._exit(0)
