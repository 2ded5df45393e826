"""The ``dqsgd`` command line: :mod:`~dqsgd.cli.commands` (train, compare, methods, configs, report, and the
wiring of ``dq`` and ``bench``), :mod:`~dqsgd.cli.launch` (distributed training: torchrun or local
processes), :mod:`~dqsgd.cli.plan` (``--dry-run``) and the ``dqsgd bench`` commands (:mod:`dqsgd.cli.bench`).

``dqsgd.cli.main`` is the console entry point (``dqsgd = "dqsgd.cli.commands:main"``); ``python -m dqsgd.cli``
runs it too.
"""

from typing import TYPE_CHECKING

from dqsgd.core.lazy import attach

if TYPE_CHECKING:
    from dqsgd.cli.commands import (cmd_compare, cmd_configs, cmd_methods, cmd_report, cmd_train, main,
                                    parser)

__getattr__, __dir__, __all__ = attach(__name__, __file__)
