"""`dqsgd bench codec` as a script: python benchmarks/bench_codec.py [--out FILE] [options] (see --help).

The table is printed; the JSON goes to --out. Implementation: dqsgd.bench.bench_codec.
"""

import sys

from dqsgd.bench import main

if __name__ == "__main__":
    sys.exit(main(["bench", "codec", *sys.argv[1:]]))
