"""Fused compiled kernels for the stochastic uniform quantizer, and the counter-based hash RNG.

* :class:`HashRNG` — uniforms u_i = hash(seed, step, worker, i), identical in numba and torch ops.
* :func:`encode_uniform_fast` — gradient → wire payload in two passes (norm; round + pack).
* :func:`decode_accumulate` — payload → ``out += w·x̂`` without temporaries.
* :func:`quantize_uniform_hash` — the torch-ops reference (any device) they are tested against.
* :func:`encode_uniform_device`, :func:`decode_accumulate_device`, :func:`decode_device` — the same
  codec on the tensor's device (:mod:`dqsgd.kernels.device`): Triton kernels on CUDA where Triton is
  installed (:mod:`dqsgd.kernels.triton_codec`, the ``gpu`` extra), torch ops elsewhere.
"""

from typing import TYPE_CHECKING

from dqsgd.core.lazy import attach

if TYPE_CHECKING:
    from dqsgd.kernels.codec import (
        decode_accumulate, encode_uniform_fast, quantize_uniform_fast, read_header, segment_starts,
    )
    from dqsgd.kernels.device import decode_accumulate_device, decode_device, encode_uniform_device
    from dqsgd.kernels.hashrng import HashRNG, hash_uniform_numpy
    from dqsgd.kernels.reference import quantize_uniform_hash

__getattr__, __dir__, __all__ = attach(__name__, __file__)
