"""Multi-process tests: gloo on 127.0.0.1, a free port per test, explicit timeouts everywhere.

``spawn_local`` forks the ranks of this session from one forkserver that imported torch and dqsgd
once and ran one step of the common methods (_warm.py): a fresh interpreter per rank spends seconds
on imports and on loading compiled kernels, and the suite starts over a hundred ranks. What the
ranks compute does not depend on how they were started; the fresh-interpreter path (`dqsgd train
--workers N`, torchrun) is run by test_launch, test_restart and test_reliability_dist.
"""

import sys
from pathlib import Path

from dqsgd.cli.launch import use_forkserver

# Spawned ranks unpickle the functions of _ranks.py by module name: make the folder importable.
sys.path.insert(0, str(Path(__file__).parent))

use_forkserver(["torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
                "torch.distributed.device_mesh", "dqsgd.cli.launch", "dqsgd.data", "dqsgd.ddp", "dqsgd.fsdp",
                "dqsgd.train.local_sgd", "dqsgd.topology.sketched", "dqsgd.train.trainer", "dqsgd.train.runner",
                "dqsgd.topology.bucket", "dqsgd.kernels.fused", "dqsgd.codecs", "_warm"])
