"""apex.parallel: data-parallel training on ``torch.distributed`` (Gloo on CPU, NCCL on GPUs).

``DistributedDataParallel`` and ``Reducer`` all-reduce gradients, ``SyncBatchNorm`` normalises over the
whole group's batch, ``LARC`` adapts per-parameter learning rates. Start the processes with ``torchrun``
and call ``torch.distributed.init_process_group(backend, timeout=...)`` first: the timeout is what turns a
dead or hung rank into an error on the others instead of a hang.
"""

import torch.distributed as _dist

from apex.parallel.distributed import (
    DistributedDataParallel,
    Reducer,
    apply_flat_dist_call,
    flat_dist_call,
    flatten,
    unflatten,
)
from apex.parallel.LARC import LARC
from apex.parallel.sync_batchnorm import (
    SyncBatchNorm,
    convert_syncbn_model,
    create_syncbn_process_group,
)

ReduceOp = _dist.ReduceOp

__all__ = [
    "LARC",
    "DistributedDataParallel",
    "ReduceOp",
    "Reducer",
    "SyncBatchNorm",
    "apply_flat_dist_call",
    "convert_syncbn_model",
    "create_syncbn_process_group",
    "flat_dist_call",
    "flatten",
    "unflatten",
]
