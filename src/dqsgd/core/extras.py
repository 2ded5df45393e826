"""Optional dependencies (``pip install 'dqsgd[EXTRA]'``): import them, or say which extra to install.

The library (codecs, quantizers, policies, the DDP hook, training) needs only torch, numpy, numba and
zstandard. The command line's progress bars (tqdm), the figures (matplotlib) and the TensorBoard logger
(tensorboard) are extras, imported here only when they are used.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# module (top-level name) -> the extra that installs it
EXTRA_OF = {"tqdm": "cli", "matplotlib": "plots", "tensorboard": "tensorboard"}


class MissingExtraError(ImportError, ValueError):
    """An optional dependency is absent. A ValueError too, so the CLI prints it as a one-line error."""


def available(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path; not imported here)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (e.g. ``"matplotlib.figure"``), or raise :class:`MissingExtraError` naming the extra."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != top:
            raise  # the package is there but one of its own dependencies is not: not ours to explain
        extra = EXTRA_OF.get(top, top)
        raise MissingExtraError(f"{purpose} needs the optional package {top!r}: pip install 'dqsgd[{extra}]' "
                                f"(or pip install {top})", name=top) from None
