"""Input-channel permutation search for 2:4 sparsity (Apex's ``permutation_search_kernels`` package).

Permuting a weight's input channels before 2:4 pruning changes which columns share a group of 4, and with it
the magnitude pruning keeps; the search maximises ``sum_after_2_to_4(W[:, perm])``. Apex runs it with CUDA
kernels (``permutation_search_cuda``); here every candidate of a step is scored with batched PyTorch tensor
operations on the matrix's device (the ``permutation_search_cuda`` compatibility module exposes the same
kernels with Apex's positional signatures).
"""

from apex.contrib.sparsity.permutation_search_kernels.call_permutation_search_kernels import (
    accelerated_search_for_good_permutation,
)
from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import sum_after_2_to_4

__all__ = ["accelerated_search_for_good_permutation", "sum_after_2_to_4"]
