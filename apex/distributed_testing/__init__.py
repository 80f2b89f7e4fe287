"""Apex's multi-process test bases under their newer home (Apex moved them here from
``apex.transformer.testing``): the same classes, which start their ranks on Gloo where there is no GPU."""

from apex.distributed_testing.distributed_test_base import (
    DistributedTestBase,
    NcclDistributedTestBase,
    UccDistributedTestBase,
)

__all__ = ["DistributedTestBase", "NcclDistributedTestBase", "UccDistributedTestBase"]
