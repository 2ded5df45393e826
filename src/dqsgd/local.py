"""Local SGD with compressed pseudo-gradients for your own training loop: :class:`LocalSGDOptimizer`.

The public home of the optimizer (``from dqsgd.local import LocalSGDOptimizer``); it is written in
:mod:`dqsgd.train.local_sgd`, beside the trainer's Local SGD rounds it shares its exchange with.
See docs/local-sgd.md.
"""

from dqsgd.train.local_sgd import CompressionStats, LocalSGDOptimizer

__all__ = ["CompressionStats", "LocalSGDOptimizer"]
