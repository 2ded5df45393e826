"""Experiment configuration: TOML files ``experiments/configs/dq-*.toml`` and dotted overrides.

A file has four kinds of tables; every key is checked (unknown keys and wrong types are refused
with a message that names them)::

    [experiment]        name, target | target_gap (+ fstar), baseline, mu_sweep, phi_sweep, fstar_iters
    [problem]           ProblemSpec fields (dataset, model, subset, l2, l1, seed, init)
    [run]               RunConfig defaults shared by every run (workers, epochs, lr, …)
    [methods.LABEL]     one run per table, in file order: ``algorithm`` (default LABEL) + RunConfig overrides

The first line of a shipped file is a comment with the exact command that runs it.
Overrides: ``experiment.KEY=V``, ``problem.KEY=V``, ``run.KEY=V``, ``methods.LABEL.KEY=V`` (TOML values).
The file checks, overrides and lookup are :mod:`dqsgd.core.config_file`'s, shared with ``dqsgd compare``'s configs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dqsgd.core.config_file import ConfigError, ConfigSchema, check_name
from dqsgd.dq.algorithms import ALGORITHMS, RUN_FIELDS, RunConfig
from dqsgd.dq.problem import ProblemSpec

__all__ = ["DQConfigError", "Experiment", "MethodRun", "shipped", "load", "build", "apply_overrides", "quick"]


class DQConfigError(ConfigError):
    """A configuration that cannot be run: says which key and what is allowed."""


@dataclass(frozen=True)
class ExperimentSpec:
    name: str = "dq"
    target: float = 0.0            # absolute training-loss target (e.g. 0.05 for the MLP [text])
    target_gap: float = 0.0        # > 0: target = F* + target_gap (logistic regression: 0.01 [OC])
    fstar: float = 0.0             # known F*; 0 with target_gap > 0: computed by L-BFGS on the training set
    fstar_note: str = ""           # where a given F* comes from (printed in the report)
    fstar_iters: int = 300         # L-BFGS iterations when F* is computed
    baseline: str = "asyfpg"       # the × savings are against this label
    mu_sweep: tuple[float, ...] = ()     # AsyLPG over μ (label "asylpg")
    phi_sweep: tuple[float, ...] = ()    # Sparse-AsyLPG over phi_div (label "sparse-asylpg")

    def __post_init__(self) -> None:
        check_name("experiment.name", self.name, DQConfigError)
        if not 1 <= self.fstar_iters <= 10**5:
            raise DQConfigError(f"experiment: fstar_iters must be in 1..100000, got {self.fstar_iters}")
        if (self.target > 0) == (self.target_gap > 0):
            raise DQConfigError("experiment: give exactly one of target (> 0) and target_gap (> 0)")
        if any(v <= 0 for v in self.mu_sweep) or any(v < 1 for v in self.phi_sweep):
            raise DQConfigError("experiment: mu_sweep values must be > 0 and phi_sweep values >= 1")


@dataclass(frozen=True)
class MethodRun:
    label: str
    cfg: RunConfig
    group: str = "main"            # "main" | "mu" | "phi"


@dataclass(frozen=True)
class Experiment:
    spec: ExperimentSpec
    problem: ProblemSpec
    base: RunConfig
    methods: tuple[MethodRun, ...] = field(default_factory=tuple)
    source: str = ""

    def runs(self) -> list[MethodRun]:
        """The table's runs, then the μ and φ sweeps (reusing a table run where the value matches)."""
        out = list(self.methods)
        by = {m.label: m for m in self.methods}
        for mu in self.spec.mu_sweep:
            base = by.get("asylpg")
            if base is not None and base.cfg.mu != mu:
                out.append(MethodRun(f"asylpg-mu{mu:g}", dataclasses.replace(base.cfg, mu=mu), "mu"))
        for phi in self.spec.phi_sweep:
            base = by.get("sparse-asylpg")
            if base is not None and base.cfg.phi_div != phi:
                out.append(MethodRun(f"sparse-asylpg-phi{phi:g}", dataclasses.replace(base.cfg, phi_div=float(phi)), "phi"))
        return out


SCHEMA = ConfigSchema(("experiment", "problem", "run"), DQConfigError, prefix="dq-", label="LABEL")


def build(raw: dict[str, Any], source: str = "") -> Experiment:
    SCHEMA.check_sections(raw)
    try:
        spec = SCHEMA.table(ExperimentSpec, raw, "experiment")
        problem = SCHEMA.table(ProblemSpec, raw, "problem")
        base = SCHEMA.table(RunConfig, raw, "run")
        methods = []
        for label, opts in SCHEMA.methods(raw):
            algo = opts.pop("algorithm", label)
            if algo not in ALGORITHMS:
                raise DQConfigError(f"methods.{label}: unknown algorithm {algo!r}; known: {', '.join(ALGORITHMS)}")
            over = SCHEMA.fields(RunConfig, f"methods.{label}", opts, base)
            methods.append(MethodRun(label, dataclasses.replace(base, algorithm=algo, **over)))
    except (TypeError, ValueError) as e:
        raise DQConfigError(str(e)) from None
    if not methods:
        raise DQConfigError("no [methods.LABEL] table: nothing to run")
    if spec.baseline not in {m.label for m in methods}:
        raise DQConfigError(f"experiment.baseline {spec.baseline!r} is not one of the methods")
    return Experiment(spec, problem, base, tuple(methods), source)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``experiment|problem|run.KEY=V`` or ``methods.LABEL.KEY=V`` (TOML values)."""
    return SCHEMA.apply_overrides(raw, overrides)


def quick(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``--quick`` setting: a small subset, ≤ 4 workers, 2 epochs, two sweep values, cheap F*."""
    out = apply_overrides(raw, [])
    exp, prob, run = out.setdefault("experiment", {}), out.setdefault("problem", {}), out.setdefault("run", {})
    prob["subset"] = min(int(prob.get("subset", 0)) or 1 << 30, 800)
    run["workers"] = min(int(run.get("workers", RUN_FIELDS["workers"].default)), 4)
    run["epochs"] = min(int(run.get("epochs", RUN_FIELDS["epochs"].default)), 2)
    run["eval_every"] = min(int(run.get("eval_every", RUN_FIELDS["eval_every"].default)), 10)
    for key in ("mu_sweep", "phi_sweep"):
        if key in exp:
            exp[key] = list(exp[key])[:2]
    exp["fstar_iters"] = min(int(exp.get("fstar_iters", 300)), 50)
    if "fstar" in exp:
        exp["fstar"] = 0.0  # a full-data F* does not hold for the subset
    for m in out["methods"].values():
        for k in ("workers", "epochs"):
            m.pop(k, None)
    return out


def shipped() -> dict[str, Path]:
    return SCHEMA.shipped()


def load_raw(name_or_path: str) -> tuple[dict[str, Any], str]:
    return SCHEMA.load_raw(name_or_path)


def load(name_or_path: str, overrides: list[str] | None = None, *, is_quick: bool = False) -> Experiment:
    raw, source = load_raw(name_or_path)
    raw = apply_overrides(raw, overrides or [])
    return build(quick(raw) if is_quick else raw, source)
