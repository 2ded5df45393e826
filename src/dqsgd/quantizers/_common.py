"""The earlier path of :mod:`dqsgd.quantizers.segments` (kept for code written against it)."""

from dqsgd.quantizers.segments import *  # noqa: F401,F403
from dqsgd.quantizers.segments import check_bits, expand, flat_float, require_finite, segment_reduce  # noqa: F401
