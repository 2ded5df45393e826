"""In-process pieces of the torch.distributed transports (no process group needed)."""

import pytest
import torch

from dqsgd.transport import TorchPSTransport, make_transport
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes
from dqsgd.transport.torch_dist import _backend_reason

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("payload, width", [(b"", 0), (b"", 5), (b"\x00\xffDQ", 4), (bytes(range(256)), 300)])
def test_bytes_round_trip_through_padded_uint8_tensors(payload: bytes, width: int) -> None:
    t = bytes_tensor(payload, torch.device("cpu"), width)
    assert t.dtype == torch.uint8 and t.numel() == width and not t[len(payload):].any()
    assert tensor_bytes(t, len(payload)) == payload


def test_refuses_without_a_process_group_or_with_a_bad_topology() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchPSTransport()
    with pytest.raises(ValueError, match="unknown topology 'ring'"):
        make_transport("ring")
    with pytest.raises(ValueError, match="timeout must be in"):
        TorchPSTransport(timeout=0)


def test_backend_errors_are_shortened_to_their_reason() -> None:
    e = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                     "[127.0.0.1]:399: Connection reset by peer. This is typically caused by a remote worker hanging")
    assert _backend_reason(e) == "Read error [127.0.0.1]:399: Connection reset by peer"
    assert _backend_reason(RuntimeError("Timed out waiting 8000ms for recv operation to complete")).startswith("Timed out")
