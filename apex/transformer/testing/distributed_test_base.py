"""Multi-process test bases (``torch.testing``'s ``MultiProcessTestCase``) for apex.transformer.

Each test method runs on ``world_size`` spawned ranks joined by ``torch.distributed``. Without CUDA GPUs
the NCCL (and UCC) bases run on Gloo CPU ranks instead, so code written for GPUs is tested anywhere;
the world size is then ``APEX_TEST_WORLD_SIZE`` (default 4, upstream's cap).

The bases come from ``torch.testing._internal``, which needs ``expecttest`` and ``numpy``: neither is a
dependency of apex or torch, so install the ``testing`` extra (``pip install "apex[testing]"``).
"""

from __future__ import annotations

import datetime
import os
import sys
import unittest

import torch
from torch import distributed as dist

try:
    from torch.testing._internal import common_distributed, common_utils
except ModuleNotFoundError as exc:  # a plain install: say which extra brings the missing package
    if exc.name not in ("expecttest", "numpy"):
        raise
    raise ModuleNotFoundError(
        f"apex.transformer.testing.distributed_test_base needs {exc.name!r} (torch.testing._internal, whose "
        f"test bases it extends, imports it): pip install \"apex[testing]\" (or: pip install expecttest numpy)",
        name=exc.name) from exc

from apex.transformer._ucc_util import HAS_UCC

_TORCH_UCC_COMPAT_NVIDIA_DRIVER_VERSION = "470.42.01"


def _nvidia_driver_version():
    if not torch.cuda.is_available():
        return None
    try:
        from packaging.version import parse
        from torch.utils import collect_env
        return parse(collect_env.get_nvidia_driver_version(collect_env.run))
    except Exception:  # noqa: BLE001 - no driver information is "unknown", not an error
        return None


_driver_version = _nvidia_driver_version()
HAS_TORCH_UCC_COMPAT_NVIDIA_DRIVER = False
if _driver_version is not None:
    from packaging.version import Version
    HAS_TORCH_UCC_COMPAT_NVIDIA_DRIVER = _driver_version >= Version(_TORCH_UCC_COMPAT_NVIDIA_DRIVER_VERSION)


def _timeout() -> datetime.timedelta:
    # Short enough that a dead rank fails the others with the process group's timeout error.
    return datetime.timedelta(seconds=float(os.environ.get("APEX_TEST_PG_TIMEOUT", "120")))


class DistributedTestBase(common_distributed.MultiProcessTestCase):
    """Spawns the ranks in ``setUp``; ``DISTRIBUTED_BACKEND`` names the backend (Gloo stands in for
    NCCL when no CUDA GPU is visible)."""

    def setUp(self) -> None:
        super().setUp()
        self._setup_pre_spawn()
        self._spawn_processes()

    def tearDown(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        super().tearDown()

    @property
    def world_size(self) -> int:
        if torch.cuda.is_available():
            return min(torch.cuda.device_count(), 4)
        return int(os.environ.get("APEX_TEST_WORLD_SIZE", "4"))

    @property
    def init_method(self):
        return f"{common_utils.FILE_SCHEMA}{self.file_name}"

    @property
    def destroy_pg_upon_exit(self) -> bool:
        return False

    @classmethod
    def _backend(cls) -> str:
        backend = cls.DISTRIBUTED_BACKEND
        if backend in ("nccl", "ucc") and not torch.cuda.is_available():
            return "gloo"
        return backend

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        print(f"[dist init] rank = {self.rank}, world_size = {self.world_size}")
        try:
            dist.init_process_group(init_method=self.init_method, backend=cls._backend(),
                                    world_size=int(self.world_size), rank=self.rank, timeout=_timeout())
        except RuntimeError as e:
            if "recompile" in e.args[0]:
                print(f"Backend of {self.DISTRIBUTED_BACKEND} not available")
                sys.exit(0)
            raise
        if torch.cuda.is_available():
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)  # ranks share the CPU
        dist.barrier()
        self.run_test(test_name, pipe)
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(0)

    def _setup_pre_spawn(self) -> None:
        pass


class NcclDistributedTestBase(DistributedTestBase):
    DISTRIBUTED_BACKEND = "nccl"


class GlooDistributedTestBase(DistributedTestBase):
    DISTRIBUTED_BACKEND = "gloo"


@unittest.skipUnless(HAS_UCC, "Requires either torch ucc or pytorch build from source with native ucc installed "
                              "and enabled")
@unittest.skipUnless(HAS_TORCH_UCC_COMPAT_NVIDIA_DRIVER,
                     f"`torch_ucc` requires NVIDIA driver >= {_TORCH_UCC_COMPAT_NVIDIA_DRIVER_VERSION} but "
                     f"{_driver_version} found. See https://github.com/openucx/ucc/issues/496")
class UccDistributedTestBase(DistributedTestBase):
    DISTRIBUTED_BACKEND = "ucc"

    def _setup_pre_spawn(self) -> None:
        self.master_addr = "localhost"
        os.environ["MASTER_ADDR"] = "localhost"
        self._has_master_port = "MASTER_PORT" in os.environ
        if self._has_master_port:
            self.master_port = os.environ["MASTER_PORT"]
        else:
            self.master_port = "12375"
            os.environ["MASTER_PORT"] = self.master_port
        self._has_ucx_tls = "UCX_TLS" in os.environ
        if not self._has_ucx_tls:
            os.environ["UCX_TLS"] = "tcp,cuda"

    def tearDown(self) -> None:
        super().tearDown()
        if not self._has_master_port:
            del os.environ["MASTER_PORT"]
        if not self._has_ucx_tls:
            del os.environ["UCX_TLS"]

    @property
    def init_method(self):
        return "tcp://localhost:" + os.environ["MASTER_PORT"]
