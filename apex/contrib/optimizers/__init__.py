"""``apex.contrib.optimizers``: Apex's legacy contrib optimizers. ``FusedAdam`` and ``FusedSGD`` keep the old
``step(closure, grads, output_params, scale, grad_norms)`` / ``materialize_master_grads`` APIs; ``FusedLAMB`` is
the same optimizer as ``apex.optimizers.FusedLAMB``, whose arguments are a superset of the contrib one's."""

from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB
from apex.contrib.optimizers.fp16_optimizer import FP16_Optimizer
from apex.contrib.optimizers.fused_adam import FusedAdam
from apex.contrib.optimizers.fused_lamb import FusedLAMB
from apex.contrib.optimizers.fused_sgd import FusedSGD

__all__ = ["DistributedFusedAdam", "DistributedFusedLAMB", "FP16_Optimizer", "FusedAdam", "FusedLAMB", "FusedSGD"]
