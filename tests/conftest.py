"""Suite-wide settings: one intra-op thread (small tensors on a shared 2-core machine run ~100x
faster than with spinning OpenMP threads), and the Hypothesis profiles.

* ``dqsgd`` (the default, `make test`): derandomized (the examples follow from each test's source,
  the same on every machine) and no example database, so a failure saved by an earlier run in
  ``.hypothesis/`` is never replayed: `make test` gives the same verdict in every clone, every time.
* ``fuzz`` (`make fuzz`, DQSGD_HYPOTHESIS=fuzz): random exploration. `make fuzz` passes the seed it
  prints as ``--hypothesis-seed`` (so a failure replays with ``make fuzz FUZZ_SEED=N``); run without a
  seed, this profile saves failures to ``.hypothesis/`` and replays them first. Only the property tests
  are collected.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.internal.detection import is_hypothesis_test

torch.set_num_threads(1)
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dqsgd", derandomize=True, database=None, **_COMMON)
settings.register_profile("ci", parent=settings.get_profile("dqsgd"))
settings.register_profile("fuzz", derandomize=False, print_blob=True, **_COMMON)
PROFILE = os.environ.get("DQSGD_HYPOTHESIS", "dqsgd")
settings.load_profile(PROFILE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under the fuzz profile keep only the Hypothesis tests: the rest has nothing random to explore."""
    if PROFILE != "fuzz":
        return
    keep = [it for it in items if is_hypothesis_test(getattr(it, "obj", None))]
    config.hook.pytest_deselected(items=[it for it in items if it not in keep])
    items[:] = keep
