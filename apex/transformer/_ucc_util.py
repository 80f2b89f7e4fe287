"""Whether the UCC backend of torch.distributed can be used (``HAS_UCC``)."""

from __future__ import annotations

import importlib.util

from torch import distributed as dist

# torch_ucc is only probed, not imported: importing apex must stay cheap and free of side effects.
HAS_UCC: bool = bool(getattr(dist, "is_ucc_available", lambda: False)()) or (
    importlib.util.find_spec("torch_ucc") is not None)
