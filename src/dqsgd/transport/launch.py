"""The old import path of :mod:`dqsgd.launch` (the process launcher is a command-line layer, above
the transports it starts). ``dqsgd.transport.launch`` is that very module object, so attribute
access and monkeypatching behave exactly as on ``dqsgd.launch``."""

import sys

from dqsgd import launch as _launch

sys.modules[__name__] = _launch
