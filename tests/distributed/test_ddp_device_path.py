"""The DDP hook's GPU code path (the torch-ops device codec, deferred payload validation), run on
CPU by forcing it: the same averaged gradients and widths as the numba path, bitwise."""

from types import SimpleNamespace

import pytest
import torch

import _hook_ranks as hr
from dqsgd.cli.launch import spawn_local
from dqsgd.codecs import PayloadError
from dqsgd.topology.state import BucketState
from dqsgd.kernels import HashRNG
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology import payloads as ddp_codec

CASES = [("qsgd-4bit", {}), ("qsgd-4bit", {"topology": "allgather"}), ("dqsgd", {}),
         ("qsgd-4bit", {"downlink_bits": 2, "downlink_feedback": True})]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_device_code_path_equals_host_path_bitwise() -> None:
    results = spawn_local(hr.device_path_runs, 2, (CASES,), timeout=60, deadline=350)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        host, device = r.value["host"], r.value["device"]
        for method, kw in CASES:
            k = f"{method}/{kw}"
            assert device[k]["bits"] == host[k]["bits"], k
            assert all(torch.equal(a, b) for a, b in zip(device[k]["runs"], host[k]["runs"])), k
            assert device[k]["stats"] == host[k]["stats"], k


def test_deferred_validation_flags_a_corrupt_payload_and_raises_a_step_later() -> None:
    m = Method(method_config("qsgd-4bit"), 1000, 10)
    ddp_codec.route_cpu_through_device_codec(True)
    try:
        good = ddp_codec.encode_uniform_payload(torch.randn(1000), 4, HashRNG(1, 0, 0), norm=m.norm, layout=m.layout)
        bad_payload = good.clone()
        bad_payload[-10] ^= 1  # a flipped body bit: the crc no longer matches
        flag = torch.zeros((), dtype=torch.bool)
        ddp_codec.accumulate(m, [good], 4, torch.zeros(1000), flag)
        assert not bool(flag)
        ddp_codec.accumulate(m, [good, bad_payload], 4, torch.zeros(1000), flag)  # no raise: deferred
        assert bool(flag)
    finally:
        ddp_codec.route_cpu_through_device_codec(False)
    bucket = SimpleNamespace(bad=flag, step=5, _bad_event=None)
    with pytest.raises(PayloadError, match="failed validation"):
        BucketState.check_payloads(bucket, 0)  # type: ignore[arg-type]
    BucketState.check_payloads(SimpleNamespace(bad=torch.zeros((), dtype=torch.bool), step=5, _bad_event=None), 0)
