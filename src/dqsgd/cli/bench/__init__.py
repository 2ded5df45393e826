"""The ``dqsgd bench`` commands. Read downward: :mod:`~dqsgd.cli.bench.parser` (argparse wiring, torch-free,
with :mod:`~dqsgd.cli.bench.gpu_parser`) loads a command's module only when it runs;
:mod:`~dqsgd.cli.bench.choices` holds what the parsers and the benchmarks share (model and hook names);
:mod:`~dqsgd.cli.bench.common` (timing, tables, JSON, ``bench step``), :mod:`~dqsgd.cli.bench.hook`,
:mod:`~dqsgd.cli.bench.fsdp`, :mod:`~dqsgd.cli.bench.gpu` and :mod:`~dqsgd.cli.bench.loopback` are the benchmarks.
No module here imports one above it.
"""
