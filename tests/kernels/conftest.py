"""Shared fixture of the Triton kernel tests that run compiled on a GPU or interpreted on the CPU."""

import os

import pytest


@pytest.fixture
def triton_kernels():
    """dqsgd's Triton kernels switched on for one test (and off after it). On the CPU they run through
    Triton's interpreter, which the module must have asked for (``TRITON_INTERPRET=1``) before Triton
    was first imported; a run where Triton was set up for a GPU skips instead."""
    if os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu") == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was set up for a GPU (TRITON_INTERPRET unset)")
    from dqsgd.kernels import device_common

    device_common.set_triton(True)
    yield
    device_common.set_triton(None)
