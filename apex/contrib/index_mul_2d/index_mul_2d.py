"""``index_mul_2d(in1, in2, idx1) = in1[idx1] * in2`` (see ``apex.ops.index_mul_2d``), with Apex's class names."""

from apex.ops.index_mul_2d import IndexMul2d as IndexMul2d_
from apex.ops.index_mul_2d import IndexMul2dBackward as IndexMul2dBackward_
from apex.ops.index_mul_2d import index_mul_2d  # IndexMul2d_.apply, through the C++ apply where it may

index_mul_2d_backward = IndexMul2dBackward_.apply

__all__ = ["IndexMul2dBackward_", "IndexMul2d_", "index_mul_2d", "index_mul_2d_backward"]
