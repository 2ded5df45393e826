"""The CPUs a process may use, and the OpenMP setting the ``dqsgd`` command runs under (no torch here).

PyTorch's CPU ops run on OpenMP threads (GNU libgomp in the PyPI wheels). Between two parallel
regions an idle OpenMP thread *spins* for a while before it sleeps (``OMP_WAIT_POLICY`` unset) —
on a machine whose cores other processes share, that spinning takes the cores from them and
from the thread that has work, and the same run costs 2-4x the CPU time. ``OMP_WAIT_POLICY=PASSIVE``
makes idle threads sleep at once. OpenMP reads it once, when torch loads, so it can only be set
before ``import torch``: the ``dqsgd`` command does it for its own process first thing
(:func:`prepare_command_process`, where the variable is unset); importing :mod:`dqsgd` changes
nothing in the caller's process. The simulation's own default is one intra-op thread
(``train.threads = 1``, :class:`dqsgd.train.config.TrainConfig`): its tensors are small, so a
second thread gains little on a quiet machine and loses much on a busy one (docs/devices.md).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

__all__ = ["COMMAND_ENVIRONMENT", "available_cpus", "command_environment", "prepare_command_process"]

COMMAND_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}  # what the dqsgd command sets where it is unset


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: what ``taskset`` or a container allows),
    not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def command_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`COMMAND_ENVIRONMENT` that ``environ`` (default: this process's) leaves
    unset: a value the user set is kept."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in COMMAND_ENVIRONMENT.items() if k not in env}


def prepare_command_process() -> bool:
    """Set :func:`command_environment` in this process, for the ``dqsgd`` command's own process only,
    before torch loads (children it starts inherit it). Where torch is already loaded (the command's
    ``main`` called from Python) it would not take effect: nothing is changed and False is returned."""
    if "torch" in sys.modules:
        return False
    os.environ.update(command_environment())
    return True
