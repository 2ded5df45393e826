"""Shared fixtures for the Double Quantization tests: a tiny seeded problem (synthetic, logreg)."""

import pytest
import torch

from dq_helpers import SPEC

from dqsgd.dq.problem import Problem


@pytest.fixture(scope="session")
def problem() -> Problem:
    torch.set_num_threads(1)
    return Problem(SPEC)
