"""Double Quantization (Yu, Wu, Huang, NeurIPS 2019): AsyLPG, Sparse-AsyLPG, Acc-AsyLPG and the
baselines QSVRG, AsyFPG, Acc-AsyFPG on one asynchronous parameter-server engine with SVRG epochs.

Pieces (each one idea, composable; docs/algorithms.md §9 is the specification, tags kept in docstrings):

* :mod:`~dqsgd.dq.modelq` — downlink: μ-rule policy + LP model quantizer (fallbacks: snapshot flag, fp32).
* :mod:`~dqsgd.dq.sparse`, :mod:`~dqsgd.dq.sparse_wire` — Sparse-AsyLPG's sparsifier and its wire format.
* :mod:`~dqsgd.dq.gradq` — uplink gradient codecs (fp32, LP(b), sparse LP(b)).
* :mod:`~dqsgd.dq.engine` — master and worker state machines; :mod:`~dqsgd.dq.sim` (event-driven
  simulation) and :mod:`~dqsgd.dq.dist` (torch.distributed, gloo) deliver their bytes.
* :mod:`~dqsgd.dq.experiment`, :mod:`~dqsgd.dq.report`, :mod:`~dqsgd.dq.cli` — configs → runs/<name>/.

>>> from dqsgd.dq import ALGORITHMS, RunConfig
>>> sorted(ALGORITHMS)
['acc-asyfpg', 'acc-asylpg', 'asyfpg', 'asylpg', 'qsvrg', 'sparse-asylpg']
"""

from typing import TYPE_CHECKING

from dqsgd.core.lazy import attach

if TYPE_CHECKING:
    from dqsgd.dq.algorithms import ALGORITHMS, Algorithm, RunConfig, make_codecs
    from dqsgd.dq.engine import EvalRecord, Master, MsgRecord, Worker
    from dqsgd.dq.gradq import Fp32Grad, GradCodec, LowPrecGrad, SparseLowPrecGrad
    from dqsgd.dq.modelq import (
        FP32_MODEL, SNAPSHOT_FLAG, ModelChoice, ModelKind, ModelPrecision, choose_model_precision, decode_model,
        encode_model, mu_rule_bits,
    )
    from dqsgd.dq.problem import Problem, ProblemSpec, lbfgs_minimum
    from dqsgd.dq.result import RunResult
    from dqsgd.dq.sim import DelayModel, run_sim
    from dqsgd.dq.sparse import SparseLP, keep_probabilities, sparse_dequantize, sparse_quantize, sparsify
    from dqsgd.dq.sparse_wire import IndexCoding, decode_sparse, encode_sparse, sparse_size
    from dqsgd.dq.dist import run_dist  # torch.distributed only when asked for

__getattr__, __dir__, __all__ = attach(__name__, __file__)
