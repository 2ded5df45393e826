"""Slow nodes in the simulation: a seeded compute-time model, a simulated wall clock, backup workers.

Compute time of worker w at step n (seconds), a pure function of (seed, n, w):

    T_{n,w} = compute_s · exp(compute_sigma · Z_{n,w}) + stall_s · 1[U_{n,w} < stall_prob],

Z standard normal, U uniform on [0, 1), both from ``seed_for(seed, COMPUTE_TIME, n)`` (numpy's PCG64):
a log-normal step time with median ``compute_s`` (its spread ``compute_sigma``) and, rarely, a long
stall. The same numbers for every method of a seed (common random numbers) and on every process.

The step's simulated wall-clock time:

    t_n = A_n + 8·(busiest rank's bytes) / (link_mbps·10⁶) + rounds · link_latency_s,

where A_n is when the server stops waiting: the last arrival (synchronous SGD) or, with
``backup_workers = b``, the (W − b)-th arrival — the b slowest workers' gradients are dropped. The
busiest rank's bytes are the ledger's (:func:`dqsgd.topology.ledger.wire_traffic`: max over ranks of its uplink
plus downlink phase bytes); ``rounds`` is the number of message exchanges (2; Sketched SGD: 4). A
method's time-to-accuracy is the sum of t_n up to the first evaluation that reaches the accuracy.

Backup workers (topology ``ps``, simulation): :class:`BackupGather` wraps the transport; its ``pick``
names to the step's server the W − b first arrivals (worker order among them), so the step averages
exactly those: G = (1/(W − b)) Σ_{w used} Q(g_w). The dropped payloads were still sent: the ledger records
every worker's bytes and which were dropped (``wasted_up_bytes``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from dqsgd.core.rng import COMPUTE_TIME, seed_for
from dqsgd.topology.registry import SIMULATED_DEFAULT, topology_of, wire_traffic


class SlowNodes:
    """The compute-time and link model of a :class:`~dqsgd.train.config.TrainConfig` (its keys
    ``compute_s``, ``compute_sigma``, ``stall_prob``, ``stall_s``, ``link_mbps``, ``link_latency_s``,
    checked there)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def compute_times(self, seed: int, step: int, workers: int) -> np.ndarray:
        """T_{n,w} for w = 0 … W−1 (float64)."""
        c = self.cfg
        rng = np.random.Generator(np.random.PCG64(seed_for(seed, COMPUTE_TIME, step)))
        z, u = rng.standard_normal(workers), rng.random(workers)
        return c.compute_s * np.exp(c.compute_sigma * z) + c.stall_s * (u < c.stall_prob)

    def comm_s(self, busiest_bytes: int, rounds: int) -> float:
        return 8.0 * busiest_bytes / (self.cfg.link_mbps * 1e6) + rounds * self.cfg.link_latency_s


def arrivals(times: Sequence[float], keep: int) -> tuple[list[int], list[int], float]:
    """(used workers, dropped workers, when the server stops waiting): the ``keep`` earliest arrivals
    (ties: the lower worker id first), each list in worker order."""
    order = sorted(range(len(times)), key=lambda w: (times[w], w))
    used, dropped = sorted(order[:keep]), sorted(order[keep:])
    return used, dropped, float(times[order[keep - 1]]) if keep else 0.0


class BackupGather:
    """A simulation transport whose server aggregates only the W − b first arrivals of each step.

    Everything but :meth:`pick` is the wrapped transport's. Before each step the trainer calls
    :meth:`begin` with the step's compute times; after it, :attr:`dropped` and :attr:`sizes` (every
    worker's payload bytes, in worker order) say what was dropped and what was sent.
    """

    def __init__(self, inner: Any, backup: int):
        if not 1 <= backup < inner.workers:
            raise ValueError(f"backup_workers must be in [1, W - 1] = [1, {inner.workers - 1}], got {backup}")
        if not topology_of(getattr(inner, "topology", SIMULATED_DEFAULT)).server or len(inner.local_workers) != inner.workers:
            raise ValueError("backup workers run in the simulation with topology 'ps' (the server waits for the "
                             "first W - b arrivals)")
        self.inner, self.backup = inner, backup
        self.used: list[int] = list(range(inner.workers))
        self.dropped: list[int] = []
        self.sizes: list[int] = []
        self.replay: dict[int, list[int]] = {}  # step -> the workers to drop (recorded by a run over processes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def steps(self) -> int:
        return int(self.inner.steps)

    @steps.setter
    def steps(self, value: int) -> None:
        self.inner.steps = value

    def begin(self, times: Sequence[float], step: int = -1) -> float:
        """This step's arrivals; returns when the server stops waiting. A step in :attr:`replay` drops
        the workers recorded there (a run over processes, replayed), whatever the times say."""
        keep = self.inner.workers - self.backup
        if step in self.replay:
            dropped = sorted(self.replay[step])
            if len(dropped) != self.backup or any(not 0 <= w < self.inner.workers for w in dropped):
                raise ValueError(f"replay of step {step}: dropped workers {dropped} are not {self.backup} of "
                                 f"{self.inner.workers} workers")
            times = [math.inf if w in dropped else t for w, t in enumerate(times)]
        self.used, self.dropped, wait = arrivals(times, keep)
        return wait

    def pick(self, sizes: Sequence[int]) -> list[int]:
        """The workers the server aggregates (:mod:`dqsgd.topology.server`), told every worker's payload bytes."""
        self.sizes = list(sizes)
        return self.used


class StepTimer:
    """The simulated wall clock of one run (and its backup workers, if any)."""

    def __init__(self, model: SlowNodes, seed: int, workers: int, transport: Any, backup: int = 0, rounds: int = 2):
        self.model, self.seed, self.workers, self.rounds = model, seed, workers, rounds
        # Over processes the transport itself serves by arrival order (dqsgd.transport.backup).
        self.arrivals = transport if getattr(transport, "arrival_order", False) else None
        self.backup = BackupGather(transport, backup) if backup and self.arrivals is None else None
        self.elapsed = 0.0  # simulated seconds of the steps so far
        self.wait = 0.0

    def transport(self, t: Any) -> Any:
        """The transport the step runs on: ``t``, or ``t`` behind the backup workers' pick."""
        return t if self.backup is None else self.backup

    def start(self, step: int, count: int = 1) -> None:
        """A step (or a Local SGD round of ``count`` steps ending at ``step``) begins: what each worker
        computes before it can send."""
        times = sum(self.model.compute_times(self.seed, s, self.workers) for s in range(step - count + 1, step + 1))
        self.wait = float(times.max()) if self.backup is None else self.backup.begin(times, step)

    def account(self, up: list[int], up_rows: list[list[int]], down: list[int], topology: str,
                wire: tuple[list[int], list[int]]) -> tuple[list[int], tuple[list[int], list[int]], list[int], float]:
        """(every worker's uplink bytes, per-rank bytes, dropped workers, this step's simulated seconds) of a
        step whose exchange reported ``up``/``up_rows``/``down``/``wire`` (with backup workers: the used ones
        only). Only the aggregating process knows the bytes; elsewhere the step's time is the wait alone."""
        dropped: list[int] = []
        served = self.backup if self.backup is not None else self.arrivals
        if served is not None and up:
            up, dropped = list(served.sizes), list(served.dropped)
            wire = wire_traffic(topology, [[b] for b in up], down)
        busiest = max((a + b for a, b in zip(*wire)), default=0)
        seconds = self.wait + self.model.comm_s(busiest, self.rounds)
        self.elapsed += seconds
        return up, wire, dropped, seconds


def check_backup(config: Any) -> None:
    """Refuse a method whose workers' messages depend on each other or on every step being used: shared
    scalers (TernGrad), error feedback (a dropped worker's memory would count what was never applied) and
    Sketched SGD (two rounds over the same workers)."""
    from dqsgd.method.config import MethodConfig

    assert isinstance(config, MethodConfig)
    if config.quantizer.shares_scalers or config.error_feedback or config.scheme == "sketch":
        raise ValueError(f"method {config.name!r}: backup workers need a method whose workers send one "
                         "independent message per step (no shared scalers, error feedback or sketch rounds)")


def check_backup_keys(cfg: Any) -> None:
    """Backup workers over processes: refuse what would need every rank at every step — checkpoints and
    coded-size measurements gather from every rank, ``on_nonfinite = "skip"`` needs every rank to agree
    to skip, the adaptive Local SGD period needs every worker's loss — and any topology but ``ps``."""
    from dqsgd.core.config_file import ConfigError

    if not topology_of(cfg.topology or SIMULATED_DEFAULT).server:
        raise ConfigError(f"backup workers over processes need topology 'ps' (the server waits for the first "
                          f"W - b arrivals), not {cfg.topology!r}")
    for bad, key in [(cfg.checkpoint_every > 0, "train.checkpoint_every = 0"), (cfg.coded_every > 0, "train.coded_every = 0"),
                     (cfg.on_nonfinite != "raise", "train.on_nonfinite = 'raise'"),
                     (cfg.local_period != "fixed", "train.local_period = 'fixed'")]:
        if bad:
            raise ConfigError(f"backup workers over processes need {key} (it would need every rank at every step)")


def check_backup_processes(cfg: Any, transport: Any, exchanges: int) -> None:
    """Over processes (:class:`~dqsgd.transport.backup.BackupPSTransport`): :func:`check_backup_keys`,
    then tell the transport how many exchanges the run has. Nothing to do in the simulation."""
    if not getattr(transport, "arrival_order", False):
        return
    if transport.backup != cfg.backup_workers:
        from dqsgd.core.config_file import ConfigError

        raise ConfigError(f"train.backup_workers = {cfg.backup_workers}, the transport serves W - {transport.backup}")
    check_backup_keys(cfg)
    transport.expect(exchanges)
