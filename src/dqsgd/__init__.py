"""dqsgd — Dynamic Quantized SGD and its baselines, with the bytes on the wire measured.

Quick use::

    import torch, dqsgd
    payload = dqsgd.encode(torch.randn(1000), scheme="uniform", bits=4)   # real bytes
    g_hat = dqsgd.decode(payload)                                          # unbiased estimate
    total = torch.zeros(1000)
    dqsgd.decode_into(payload, total, weight=0.5)                          # total += g_hat / 2, on its device

See ``dqsgd.method.config`` for the method registry, ``dqsgd.policies`` for the bit policies
(DQSGD eqs. 18/20, budgeted, error target, Adaptive, AdaQS), ``dqsgd.ddp`` for the DDP hook,
``dqsgd.fsdp`` for FSDP2 compression and ``dqsgd.local`` for Local SGD in your own loop.

Importing dqsgd changes nothing in the process (no import hooks, no global settings).
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["encode", "encode_tensor", "decode", "decode_into", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import dqsgd.quantizers` does not load the compiled codec kernels.
    if name in ("encode", "encode_tensor", "decode", "decode_into"):
        from dqsgd import api

        return getattr(api, name)
    raise AttributeError(f"module 'dqsgd' has no attribute {name!r}")
