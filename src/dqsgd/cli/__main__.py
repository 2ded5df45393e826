"""``python -m dqsgd.cli``: the ``dqsgd`` command."""

import sys

from dqsgd.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
