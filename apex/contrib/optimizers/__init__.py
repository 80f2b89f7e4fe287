"""``apex.contrib.optimizers``: Apex's legacy contrib optimizers. ``FusedAdam`` and ``FusedSGD`` keep the old
``step(closure, grads, output_params, scale, grad_norms)`` / ``materialize_master_grads`` APIs; ``FusedLAMB`` is
the same optimizer as ``apex.optimizers.FusedLAMB``, whose arguments are a superset of the contrib one's."""

from apex.contrib.optimizers.fused_adam import FusedAdam
from apex.contrib.optimizers.fused_lamb import FusedLAMB
from apex.contrib.optimizers.fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedLAMB", "FusedSGD"]
