"""``apex.contrib.nccl_allocator`` and the ``_apex_nccl_allocator`` / ``_nccl_version_getter`` modules.

Without CUDA the context manager is a no-op and allocations are normal; the CUDA path's logic (pool
activation, NCCL registration order) is checked with stand-ins for the CUDA pieces.
"""

from __future__ import annotations

import contextlib

import _apex_nccl_allocator
import _nccl_version_getter
import pytest
import torch

import apex.contrib.nccl_allocator as nccl_allocator
from apex.contrib.nccl_allocator import nccl_allocator as impl

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_init_sets_nccl_environment(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "1")
    nccl_allocator.init()
    import os

    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] == "0"


@no_cuda
def test_cpu_context_manager_is_a_noop():
    pool = nccl_allocator.create_nccl_mem_pool()
    assert pool is None and _apex_nccl_allocator.get_nccl_allocator() is None
    a = torch.randn(64, 3)
    for enabled in (True, False):
        with nccl_allocator.nccl_mem(pool, enabled=enabled):
            b = a * 2 + 1
            c = torch.empty(1000).fill_(3.0)
        assert torch.equal(b, a * 2 + 1) and b.device.type == "cpu" and bool((c == 3).all())
    with pytest.raises(KeyError), nccl_allocator.nccl_mem(pool):
        raise KeyError("exceptions pass through")


@no_cuda
def test_cpu_pool_given_without_cuda_is_an_error():
    with pytest.raises(RuntimeError, match="CUDA"):
        nccl_allocator.nccl_mem(object())
    with pytest.raises(TypeError, match="symmetric"):
        nccl_allocator.create_nccl_mem_pool(symmetric="yes")


def test_nccl_version(monkeypatch):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert _nccl_version_getter.get_nccl_version() == (2, 21)

    def missing():
        raise AttributeError("no NCCL")

    monkeypatch.setattr(torch.cuda.nccl, "version", missing)
    with pytest.raises(RuntimeError, match="NCCL is not available"):
        _nccl_version_getter.get_nccl_version()


class _Backend:
    def __init__(self, log):
        self.log = log
        self.mem_allocator = "ncclMemAlloc-allocator"

    def register_mem_pool(self, pool):
        self.log.append(("register", pool))

    def deregister_mem_pool(self, pool):
        self.log.append(("deregister", pool))


class _Group:
    def __init__(self, log):
        self.backend = _Backend(log)
        self.devices = []

    def _get_backend(self, device):
        self.devices.append(device)
        return self.backend


def test_cuda_path_with_stand_ins(monkeypatch):
    log = []
    group = _Group(log)

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        log.append(("use", pool, device))
        yield
        log.append(("leave", pool))

    monkeypatch.setattr(impl, "_cuda", lambda: True)
    monkeypatch.setattr(impl, "_nccl_group", lambda g=None: g if g is not None else group)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "MemPool", lambda allocator=None, **kw: ("pool", allocator, kw))
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)

    assert impl.get_nccl_allocator() == "ncclMemAlloc-allocator"
    pool = nccl_allocator.create_nccl_mem_pool()
    assert pool == ("pool", "ncclMemAlloc-allocator", {})
    with pytest.raises(ValueError, match="symmetric"):
        nccl_allocator.create_nccl_mem_pool(symmetric=True)
    monkeypatch.setattr(torch.cuda, "MemPool", lambda allocator=None, symm_mem=False: ("pool", allocator, symm_mem))
    assert nccl_allocator.create_nccl_mem_pool(symmetric=True) == ("pool", "ncclMemAlloc-allocator", True)
    group.devices.clear()
    with nccl_allocator.nccl_mem(pool, device="cuda:1"):
        log.append("allocate")
    cuda1 = torch.device("cuda", 1)
    assert log == [("use", pool, cuda1), ("deregister", pool), "allocate", ("register", pool), ("leave", pool)]
    assert group.devices == [cuda1, cuda1]

    log.clear()
    with nccl_allocator.nccl_mem(pool, enabled=False):
        pass
    assert log == []
    with pytest.raises(ValueError, match="CUDA device"):
        nccl_allocator.nccl_mem(pool, device="cpu")
    with pytest.raises(TypeError, match="device"):
        nccl_allocator.nccl_mem(pool, device=1.5)
