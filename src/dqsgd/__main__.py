import sys

from dqsgd.cli import main

sys.exit(main())
