"""``python -m dqsgd.theory``: the same command as ``python -m dqsgd.experiments.theory_checks``."""

import sys

from dqsgd.theory.cli import main

sys.exit(main())
