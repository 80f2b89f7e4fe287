"""``from apex.contrib.optimizers.fused_lamb import FusedLAMB``, as in Apex."""

from apex.optimizers.fused_lamb import FusedLAMB

__all__ = ["FusedLAMB"]
