"""The wire codec: fixed-width bit packing, Elias-omega and rANS coding and the versioned payload format.

``encode(q, coding) -> bytes`` and ``decode(payload) -> Quantized`` are the entry points
(``coded_size(payload)``: the length the payload's levels take with the best coding;
``max_payload_bytes(numel, bits, ...)``: the most bytes any payload of numel elements can take); the
payload layout is documented in :mod:`dqsgd.codecs.header` and :mod:`dqsgd.codecs.wire`.
"""

from typing import TYPE_CHECKING

from dqsgd.core.lazy import attach

if TYPE_CHECKING:
    from dqsgd.codecs.bitpack import pack_bits, packed_size, unpack_bits
    from dqsgd.codecs.bounds import max_payload_bytes
    from dqsgd.codecs.elias import EliasError, elias_bit_length, elias_decode, elias_encode, omega_length
    from dqsgd.codecs.header import Coding, PayloadError, header_size
    from dqsgd.codecs.rans import RansError, rans_decode, rans_encode
    from dqsgd.codecs.ransx import ransx_decode, ransx_encode
    from dqsgd.codecs.wire import coded_size, decode, encode, predicted_size

__getattr__, __dir__, __all__ = attach(__name__, __file__)
