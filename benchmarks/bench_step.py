"""`dqsgd bench step` as a script: python benchmarks/bench_step.py [--out FILE] [options] (see --help).

The table is printed; the JSON goes to --out. Implementation: dqsgd.cli.bench.common.bench_step (in the package:
it times the public Trainer.step()).
"""

import sys

from dqsgd.cli.bench.parser import main

if __name__ == "__main__":
    sys.exit(main(["bench", "step", *sys.argv[1:]]))
