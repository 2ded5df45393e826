"""``dqsgd bench step --contention``: what a training job costs when other processes share the CPUs.

A short fixed job (``dqsgd train`` of one method of a config, in a child process) runs quiet, then
again beside ``--busy`` busy loops (child processes spinning, killed after). For each run the job's
CPU time (user + sys, ``getrusage(RUSAGE_CHILDREN)`` around its wait: the busy loops are reaped only
later) and wall time are measured. Runs alternate quiet/loaded ``--repeats`` times, so a change in the
machine's other load hits both alike; the medians are compared with the targets: CPU time loaded /
quiet ≤ 1.2 (threads that wait must not burn CPU), wall time loaded / quiet ≤ the fair share of a job
on all the CPUs, (CPUs + busy loops) / CPUs. Timing is a measurement, not a test: the figures move with
whatever else the machine runs (the load average is printed with them).

The job's environment is set here, not by the ``dqsgd`` command's start (:mod:`dqsgd.core.cpus`):
``--wait-policy passive`` is what the command sets, ``openmp-default`` leaves ``OMP_WAIT_POLICY``
unset (OpenMP's idle threads spin before they sleep), to measure the old behaviour with ``--threads 0``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dqsgd.core.cpus import COMMAND_ENVIRONMENT, available_cpus

__all__ = ["bench_contention", "job_command", "job_environment"]

CPU_TARGET = 1.2  # loaded CPU time / quiet CPU time
# The job runs the dqsgd command's main with torch loaded first, so the command leaves the environment
# it was given as it is (dqsgd.core.cpus.prepare_command_process): the wait policy is the benchmark's.
_JOB = "import sys, torch; from dqsgd.cli.commands import main; sys.exit(main(sys.argv[1:]))"
_BUSY = "while True: pass"


def job_command(args: argparse.Namespace, out: Path) -> list[str]:
    """The training job: ``dqsgd train`` of ``--method`` of ``--config``, ``--steps`` steps, ``--threads``
    torch threads, one evaluation (at the end), writing to ``out``."""
    sets = [f"train.steps={args.steps}", f"train.eval_every={args.steps}", f"train.threads={args.threads}",
            "train.checkpoint_every=0", *(args.set or [])]
    return [sys.executable, "-c", _JOB, "train", "--config", args.config, "--method", args.method, "--quiet",
            "--out", str(out), *(w for s in sets for w in ("--set", s))]


def job_environment(wait_policy: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with OMP_WAIT_POLICY as ``wait_policy`` says ("passive": the dqsgd
    command's; "openmp-default": unset)."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in COMMAND_ENVIRONMENT}
    return {**env, **COMMAND_ENVIRONMENT} if wait_policy == "passive" else env


def _run_job(cmd: list[str], env: dict[str, str], busy: int, deadline: float) -> dict[str, float]:
    loops = [subprocess.Popen([sys.executable, "-c", _BUSY], stdin=subprocess.DEVNULL) for _ in range(busy)]
    try:
        if loops:
            time.sleep(0.5)  # the loops are spinning before the job starts
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        job = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        try:
            _, err = job.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            job.kill()
            job.communicate()
            raise SystemExit(f"dqsgd bench step --contention: the job took over {deadline:g} s; stopped") from None
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the job only: the loops are not reaped yet
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()
    if job.returncode != 0:
        raise SystemExit(f"dqsgd bench step --contention: the job failed (exit {job.returncode}):\n{err.strip()}")
    user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"wall_s": wall, "cpu_s": user + sys_, "user_s": user, "sys_s": sys_, "loadavg_1m": os.getloadavg()[0]}


def bench_contention(args: argparse.Namespace) -> dict[str, Any]:
    """Run the job quiet and loaded, ``args.repeats`` times each (alternating); print and return the figures."""
    if args.busy < 1 or args.repeats < 1 or args.steps < 1:
        raise SystemExit("dqsgd bench step --contention: --busy, --repeats and --steps must be >= 1")
    env, cpus = job_environment(args.wait_policy), available_cpus()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dqsgd-contention-") as tmp:
        for r in range(args.repeats):
            for busy in (0, args.busy):
                cmd = job_command(args, Path(tmp, f"r{r}-busy{busy}"))
                rows.append({"run": "quiet" if busy == 0 else f"{busy} busy loops", "repeat": r,
                             **_run_job(cmd, env, busy, args.deadline)})
    med = {k: {f: statistics.median(x[f] for x in rows if (x["run"] == "quiet") == (k == "quiet"))
               for f in ("wall_s", "cpu_s")} for k in ("quiet", "loaded")}
    from dqsgd.cli.bench.common import print_table, write_result  # (torch and the kernels: after the runs)

    cpu_ratio = med["loaded"]["cpu_s"] / med["quiet"]["cpu_s"]
    wall_ratio = med["loaded"]["wall_s"] / med["quiet"]["wall_s"]
    fair = (cpus + args.busy) / cpus
    policy = COMMAND_ENVIRONMENT["OMP_WAIT_POLICY"] if args.wait_policy == "passive" else "unset"
    print(f"dqsgd train --config {args.config} --method {args.method}: {args.steps} steps, train.threads = "
          f"{args.threads}, OMP_WAIT_POLICY {policy}; {cpus} CPUs, {args.busy} busy loops; {args.repeats} repeat(s)")
    print_table(rows, ["run", "repeat", "wall_s", "cpu_s", "user_s", "sys_s", "loadavg_1m"])
    print(f"loaded / quiet (medians): CPU time x{cpu_ratio:.2f} (target <= {CPU_TARGET:g}), "
          f"wall time x{wall_ratio:.2f} (fair share x{fair:.2f})")
    result = {"config": args.config, "method": args.method, "steps": args.steps, "threads": args.threads,
              "wait_policy": args.wait_policy, "busy": args.busy, "cpus": cpus, "rows": rows,
              "cpu_ratio": cpu_ratio, "wall_ratio": wall_ratio, "cpu_target": CPU_TARGET, "wall_target": fair,
              "within_targets": cpu_ratio <= CPU_TARGET and wall_ratio <= fair}
    write_result(result, args.out)
    return result
