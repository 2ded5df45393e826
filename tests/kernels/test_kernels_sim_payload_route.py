"""Which methods' payloads stay on the device in the simulation (the trainer's exchange of a bucket on
a CUDA device) and which go through the host, pinned per method (docs/gpu-codec.md, "Which payloads
stay on the device"). Run on the CPU with the device path forced
(``payloads.route_cpu_through_device_codec``: the routing a CUDA bucket takes; the torch-ops device
codec, whose routing is the Triton codec's): a payload goes through the host where it is made or read
by a host codec: ``Method.encode`` (the host encoder, on a CPU copy of the shard),
``Method.decode_uplink`` (signSGD's vote reads the codes on the host), the host decoder
``decode_accumulate`` (the device decoder's fallback for codings and schemes it has no kernel for), or
``payloads.tensor_bytes`` (a payload tensor read back to bytes). Each of those is made to raise after
warm-up; a device method's bucket must not call any, and a host method's first call is its reason."""

import pytest
import torch

from dqsgd.kernels import device_common, device_decode
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology import payloads
from dqsgd.topology.bucket import BucketProtocol
from dqsgd.topology.exchange import in_process

HOST_CODEC = ((Method, "encode"), (Method, "decode_uplink"), (device_decode, "decode_accumulate"),
              (payloads, "tensor_bytes"))

# method (config overrides) → None: its payloads stay on the device; else the host codec call it makes first
ROUTES = {
    ("qsgd-4bit", ()): None,
    ("qsgd-2bit", ()): None,
    ("dqsgd", ()): None,  # its widths change per step; the policy's 3 statistics go to pinned host memory
    ("qsgd-4bit-elias", ()): "Method.encode",  # entropy-coded body: no device kernel
    ("qsgd", (("error_feedback", True),)): "Method.encode",  # the residual is kept by the host encoder
    ("sgd", ()): "Method.encode",  # fp32: the identity codec frames it on the host
    ("signsgd", ()): "Method.encode",
    ("ef-signsgd", ()): "Method.encode",
    ("terngrad", ()): "Method.encode",
}


class HostCodec(AssertionError):
    pass


@pytest.mark.parametrize("name, overrides", sorted(ROUTES))
def test_simulation_payload_route(name: str, overrides: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    n, world = 3001, 3
    cfg = method_config(name, **dict(overrides))
    proto = BucketProtocol(cfg, n, [n], topology="sharded", workers=world, seed=0, total_steps=10,
                           downlink_bits=8 if cfg.scheme == "uniform" else None)
    flats = [torch.randn(n, generator=torch.Generator().manual_seed(w)) for w in range(world)]
    device_common.set_triton(False)
    payloads.route_cpu_through_device_codec(True)
    try:
        in_process(proto, flats, cfg.bits, 0)  # warm-up: plans, tables
        for owner, attr in HOST_CODEC:
            where = f"{getattr(owner, '__name__', owner).rsplit('.', 1)[-1]}.{attr}"

            def refuse(*a, where=where, **k):  # noqa: ANN002, ANN003, ANN202
                raise HostCodec(where)
            monkeypatch.setattr(owner, attr, refuse)
        try:
            update = in_process(proto, flats, cfg.bits, 1)
            route = None
        except HostCodec as e:
            route, update = str(e), None
    finally:
        payloads.route_cpu_through_device_codec(False)
        device_common.set_triton(None)
    assert route == ROUTES[(name, overrides)], (name, route)
    assert update is None or bool(torch.isfinite(update).all())
