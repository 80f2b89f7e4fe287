"""``apex.fused_dense``: dense layers whose bias (and GELU) live in the GEMM, as Apex's cuBLASLt layers."""

from apex.fused_dense.fused_dense import (
    DenseNoBiasFunc,
    FusedDense,
    FusedDenseFunc,
    FusedDenseGeluDense,
    FusedDenseGeluDenseFunc,
    dense_no_bias_function,
    fused_dense_function,
    fused_dense_gelu_dense_function,
)

__all__ = [
    "DenseNoBiasFunc",
    "FusedDense",
    "FusedDenseFunc",
    "FusedDenseGeluDense",
    "FusedDenseGeluDenseFunc",
    "dense_no_bias_function",
    "fused_dense_function",
    "fused_dense_gelu_dense_function",
]
