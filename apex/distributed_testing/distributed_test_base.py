"""``apex.distributed_testing.distributed_test_base``: the classes and flags of
:mod:`apex.transformer.testing.distributed_test_base` (one implementation, two import paths, as in Apex)."""

from apex.distributed_testing._ucc_util import HAS_UCC
from apex.transformer.testing.distributed_test_base import (
    _TORCH_UCC_COMPAT_NVIDIA_DRIVER_VERSION,
    HAS_TORCH_UCC_COMPAT_NVIDIA_DRIVER,
    DistributedTestBase,
    GlooDistributedTestBase,
    NcclDistributedTestBase,
    UccDistributedTestBase,
)

__all__ = ["DistributedTestBase", "GlooDistributedTestBase", "HAS_TORCH_UCC_COMPAT_NVIDIA_DRIVER", "HAS_UCC",
           "NcclDistributedTestBase", "UccDistributedTestBase", "_TORCH_UCC_COMPAT_NVIDIA_DRIVER_VERSION"]
