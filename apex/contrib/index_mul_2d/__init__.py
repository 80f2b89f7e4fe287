"""Apex's ``apex.contrib.index_mul_2d``: ``in1[idx1] * in2`` with deterministic gradients."""

from apex.contrib.index_mul_2d.index_mul_2d import index_mul_2d

__all__ = ["index_mul_2d"]
