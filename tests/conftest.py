"""Suite-wide settings: one intra-op thread (small tensors on a shared 2-core machine run ~100x
faster than with spinning OpenMP threads), and a Hypothesis profile that bounds example counts."""

import os

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)
settings.register_profile("dqsgd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dqsgd")
