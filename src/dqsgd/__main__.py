import sys

from dqsgd.cli.commands import main

sys.exit(main())
