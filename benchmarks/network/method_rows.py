"""The row names of the shaped-link benchmark (bench_network.py) and what each asks of a rank.

A dqsgd row is ``METHOD[VARIANT][@DOWN]``:

* ``METHOD``: any name of ``dqsgd methods``;
* ``VARIANT``: none (dqsgd's DDP hook, topology ``sharded``), ``-allgather`` (the hook on the all-gather
  topology), ``-trainer`` (dqsgd's own trainer, sharded, no overlap with backward), ``-ps`` (the trainer
  on a parameter server, rank 0), ``-backupB`` (the trainer on a parameter server that aggregates the
  first W − B uplinks of every step and drops the stragglers': synchronous SGD with B backup workers,
  :class:`dqsgd.transport.backup.BackupPSTransport`);
* ``@DOWN``: the sharded downlink of this row, overriding ``--downlink-bits``: a width 2..16 (a width
  below 4 without error feedback runs as asked, to measure it), ``fp32``, or ``auto`` — the both-leg
  budget split (:mod:`dqsgd.policies.split`), which budgeted methods (``dqsgd``, ``dqsgd-coded``) use
  by default in the hook and the trainer; a trailing ``e`` (``@2e``, ``@autoe``) makes it error-fed;
  ``@auto:D`` / ``@autoe:D`` gives the split ``downlink_target_bits = D`` (else ``--downlink-target-bits``).

A bare row takes ``--downlink-bits`` (default 8, the setting of the committed tables), so ``dqsgd``
alone runs an 8-bit downlink, except the link policy's (``dqsgd-link``), which chooses its downlink
width each step as ``HookState(method="dqsgd-link")`` does (``dqsgd-link@8`` pins it); ``dqsgd@auto`` is the hook as ``HookState(method="dqsgd")`` builds it.
``--downlink-bits auto`` gives every row its method's own default instead (``HookState(downlink_bits=
None)``, ``train.downlink_bits = 0``): the split for the budgeted methods, 8 bits for the others.

Sketched SGD (``sketched-sgd``) sends two message rounds per step (sketches, then the candidates'
values), which DDP's one-future-per-bucket hook cannot carry: it runs only as ``sketched-sgd-trainer``
(or ``-ps``), where its workers' momentum ρ (``sketch_momentum``) replaces the optimizer's. The
trainer builds the configuration's model, so these rows do not take ``--hidden``.
"""

from __future__ import annotations

import argparse
from typing import Any

TORCH_HOOKS = ("fp32", "fp16", "powersgd")
VARIANTS = {"": ("hook", "sharded"), "-allgather": ("hook", "allgather"), "-trainer": ("trainer", "sharded"),
            "-ps": ("trainer", "ps")}
BACKUP = "-backup"  # followed by the number of backup workers: the trainer on topology ps
AUTO = "auto"
METHOD_SYNTAX = ("fp32 | fp16 | powersgd[-rN] | DQSGD_METHOD[-allgather|-trainer|-ps|-backupB][@DOWN] "
                 "(DQSGD_METHOD: any name of `dqsgd methods`, e.g. qsgd-2bit, dqsgd, dqsgd-coded; sketched-sgd "
                 "with -trainer or -ps only; -backupB: B backup workers on a parameter server; DOWN: the sharded "
                 "downlink of this row, 2..16, fp32 or auto (the budgeted methods' both-leg split), overriding "
                 "--downlink-bits; a trailing 'e' (e.g. @2e, @autoe) makes it error-fed; @auto:D or @autoe:D sets "
                 "the split's downlink_target_bits to D; a width below 4 "
                 "without 'e' runs as asked (allow_unsafe_downlink))")


def _config(name: str) -> Any:
    """The registered method ``name``'s config, or None."""
    from dqsgd.method.config import method_config

    try:
        return method_config(name)
    except (ValueError, TypeError, KeyError):
        return None


def split_downlink(method: str) -> tuple[str, str | None]:
    """(the row without ``@DOWN``, DOWN without its ``:TARGET`` or None)."""
    name, at, down = method.partition("@")
    return name, (down.partition(":")[0] if at else None)


def row_down_target(method: str) -> str | None:
    """The ``TARGET`` of a row's ``@auto[e]:TARGET`` (its ``downlink_target_bits``), as written; None: none."""
    _, colon, target = method.partition("@")[2].partition(":")
    return target if colon else None


def backup_workers(method: str) -> int:
    """B of a ``-backupB`` row (0 otherwise)."""
    name = split_downlink(method)[0]
    head, sep, b = name.rpartition(BACKUP)
    return int(b) if sep and head and b.isdigit() else 0


def variant(method: str) -> tuple[str, str, str] | None:
    """(dqsgd method, engine "hook" or "trainer", topology) of a dqsgd row; None for PyTorch's rows and
    for names that are not a registered dqsgd method with an optional suffix."""
    name, _ = split_downlink(method)
    if backup_workers(method):
        base = name.rpartition(BACKUP)[0]
        return (base, "trainer", "ps") if base not in TORCH_HOOKS and _config(base) is not None else None
    for suffix in sorted(VARIANTS, key=len, reverse=True):
        base = name.removesuffix(suffix) if suffix else name
        if (not suffix or name.endswith(suffix)) and base and base not in TORCH_HOOKS and _config(base) is not None:
            return (base, *VARIANTS[suffix])
    return None


def powersgd_rank(method: str) -> int | None:
    """The matrix rank of a PowerSGD row (``powersgd`` = rank 1, ``powersgd-r4`` = rank 4); None otherwise."""
    if method == "powersgd":
        return 1
    head, _, rank = method.partition("-r")
    return int(rank) if head == "powersgd" and rank.isdigit() and int(rank) >= 1 else None


def _number_in(text: str, low: float, high: float) -> bool:
    """Whether ``text`` is a number in (low, high]."""
    try:
        return low < float(text) <= high
    except ValueError:
        return False


def down_ok(down: str) -> bool:
    """Whether ``down`` spells a downlink: 2..16, fp32 or auto, with an optional trailing 'e' (not on fp32)."""
    width = down.removesuffix("e")
    return down == "fp32" or width == AUTO or (width.isdigit() and 2 <= int(width) <= 16)


def dqsgd_problem(method: str, workers: int | None = None) -> str:
    """Why the dqsgd row ``method`` cannot run ("" if it can); ``workers``: W, where known."""
    from dqsgd.topology.names import check_auto_downlink
    from dqsgd.train.slownodes import check_backup

    v, (_, down) = variant(method), split_downlink(method)
    if v is None:
        return f"unknown method {method!r}"
    base, engine, topology = v
    config = _config(base)
    if down is not None and (topology != "sharded" or not down_ok(down)):
        return f"{method!r}: @DOWN needs the sharded topology and 2..16, fp32 or auto (error-fed: 2e..16e, autoe)"
    target = row_down_target(method)
    if target is not None and (down is None or down.removesuffix("e") != AUTO or not _number_in(target, 0, 16)):
        return f"{method!r}: ':TARGET' follows @auto or @autoe only: the downlink's bits per coordinate, in (0, 16]"
    if config.scheme == "sketch" and engine == "hook":
        return (f"{method!r}: Sketched SGD sends two message rounds per step, which the DDP hook does not run; "
                f"use {base}-trainer or {base}-ps")
    try:
        if down is not None and down.removesuffix("e") == AUTO:
            check_auto_downlink(topology, config.aggregate == "majority", config.policy)
        if backup_workers(method):
            check_backup(config)
    except ValueError as e:
        return f"{method!r}: {e}"
    b = backup_workers(method)
    if b and workers is not None and not 1 <= b < workers:
        return f"{method!r}: backup workers must be in [1, W - 1] = [1, {workers - 1}]"
    return ""


def row_down(a: argparse.Namespace) -> str:
    """The DOWN this rank's row runs: its ``@DOWN``; else for a link-policy row on ``sharded``
    (``dqsgd-link``) ``auto``, the downlink it chooses itself from its time model; else ``--downlink-bits``."""
    own, row = split_downlink(a.method)[1], variant(a.method)
    if own:
        return own
    link = row is not None and row[2] == "sharded" and getattr(_config(row[0]), "policy", "") == "link"
    return AUTO if link else a.downlink_bits


def downlink(a: argparse.Namespace) -> int | str | None:
    """This rank's downlink width: the row's ``@DOWN`` if it has one, else ``--downlink-bits``; ``"auto"``
    from the row, None (the method's default) from ``--downlink-bits auto`` or a bare link-policy row
    (:func:`row_down`), ``"fp32"`` or an int."""
    own = split_downlink(a.method)[1]
    down = row_down(a).removesuffix("e")
    if down == AUTO:
        return AUTO if own else None
    return "fp32" if down == "fp32" else int(down)


def downlink_options(a: argparse.Namespace) -> dict[str, Any]:
    """The downlink's switches (HookState's and TrainConfig's names): error-fed when the width ends in
    'e'; a row asks for its width explicitly, so a low width without feedback runs (to measure it). The
    budgeted split keeps HookState's defaults (it picks widths below 4 only when error-fed) and takes
    ``--downlink-target-bits``."""
    down = row_down(a)
    auto = down.removesuffix("e") == AUTO
    row, own = variant(a.method), row_down_target(a.method)
    budgeted = row is not None and getattr(_config(row[0]), "policy", "") in ("dqsgd-budget", "dqsgd-coded")
    bits = float(own) if own is not None else a.downlink_target_bits
    target = {"downlink_target_bits": bits} if auto and budgeted and bits else {}
    return {"downlink_feedback": down.endswith("e"), "allow_unsafe_downlink": not auto, **target}
