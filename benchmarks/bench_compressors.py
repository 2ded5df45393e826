"""`dqsgd bench compressors` as a script: python benchmarks/bench_compressors.py [--out FILE] [options] (see --help).

The table is printed; the JSON goes to --out. Implementation: dqsgd.bench.bench_compressors.
"""

import sys

from dqsgd.bench import main

if __name__ == "__main__":
    sys.exit(main(["bench", "compressors", *sys.argv[1:]]))
