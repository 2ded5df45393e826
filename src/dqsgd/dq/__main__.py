"""``python -m dqsgd.dq run|list``."""

import sys

from dqsgd.dq.cli import main

if __name__ == "__main__":
    sys.exit(main())
