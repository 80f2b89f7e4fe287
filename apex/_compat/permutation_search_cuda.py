"""Compatibility module for code that does ``import permutation_search_cuda`` (Apex's compiled permutation
search kernels for ASP). Names are resolved on first access; see
``apex.contrib.sparsity.permutation_search_kernels.array_kernels`` for the semantics.
"""

from __future__ import annotations

from apex._compat import lazy_module

_KERNELS = "apex.contrib.sparsity.permutation_search_kernels.array_kernels"

# name -> module holding it ("module:attr" where the name differs)
_OPS: dict[str, str] = {
    "sum_after_2_to_4": f"{_KERNELS}:subset_sum_after_2_to_4",
    "build_permute_map": _KERNELS,
    "check_permutations": _KERNELS,
    "build_swap_map": _KERNELS,
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
