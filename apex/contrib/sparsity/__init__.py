"""``apex.contrib.sparsity``: ASP (automatic 2:4 structured sparsity) and ``create_mask``."""

from apex.contrib.sparsity.asp import ASP
from apex.contrib.sparsity.sparse_masklib import create_mask

__all__ = ["ASP", "create_mask"]
