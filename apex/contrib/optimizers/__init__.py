"""``apex.contrib.optimizers``: the contrib ``FusedLAMB`` (the same optimizer as ``apex.optimizers.FusedLAMB``,
whose arguments are a superset of the contrib one's)."""

from apex.contrib.optimizers.fused_lamb import FusedLAMB

__all__ = ["FusedLAMB"]
