"""``python -m dqsgd.experiments.theory``: the same command as ``python -m dqsgd.experiments.theory_checks``."""

import sys

from dqsgd.experiments.theory.cli import main

sys.exit(main())
