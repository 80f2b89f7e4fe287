"""Module-level names of NVIDIA Apex that client code imports by path, beyond the packages' ``__init__``
names (``tests/test_upstream_names.py``): each must be the object Apex's name stood for, not a stand-in."""

from __future__ import annotations

import importlib

import torch


def test_apex_C_flattens_and_unflattens_like_apex():
    apex_C = importlib.import_module("apex_C")
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 1, 2)]
    flat = apex_C.flatten(tensors)
    assert flat.shape == (12 + 5 + 4,) and flat.is_contiguous()
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    views = apex_C.unflatten(flat, tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    for v, t in zip(views, tensors):
        assert torch.equal(v, t)
    flat.zero_()  # views of the flat buffer, as Apex's unflatten_dense_tensors returned
    assert all(not v.any() for v in views)


def test_rng_tracker_global_is_the_tracker_the_functions_use():
    from apex.transformer.tensor_parallel import random as tp_random

    tracker = tp_random._CUDA_RNG_STATE_TRACKER
    assert tracker is tp_random.get_cuda_rng_tracker()
    tracker.reset()
    try:
        tracker.add("client-state", 1234)
        assert "client-state" in tp_random.get_cuda_rng_tracker().get_states()
    finally:
        tracker.reset()
    assert tp_random._CHECKPOINTED_ACTIVATIONS_MEMORY_BUFFER is tp_random._Tracker.checkpointed_activations_buffer


def test_amp_version_module():
    version = importlib.import_module("apex.amp.__version__")
    assert version.VERSION == (0, 1, 0) and version.__version__ == "0.1.0"


def test_distributed_testing_is_apex_newer_home_of_the_test_bases():
    import apex.distributed_testing as dt
    from apex.distributed_testing import _ucc_util, distributed_test_base
    from apex.transformer import _ucc_util as tp_ucc
    from apex.transformer.testing import distributed_test_base as tp_base

    for name in ("DistributedTestBase", "NcclDistributedTestBase", "UccDistributedTestBase"):
        assert getattr(dt, name) is getattr(tp_base, name) is getattr(distributed_test_base, name)
    assert distributed_test_base.HAS_TORCH_UCC_COMPAT_NVIDIA_DRIVER == tp_base.HAS_TORCH_UCC_COMPAT_NVIDIA_DRIVER
    assert _ucc_util.HAS_UCC == tp_ucc.HAS_UCC


def test_clip_grad_module_path():
    from apex.contrib.clip_grad import clip_grad as module
    from apex.contrib.clip_grad import clip_grad_norm_

    assert module.clip_grad_norm_ is clip_grad_norm_
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    total = module.clip_grad_norm_([p], max_norm=1.0)
    assert abs(float(total) - 6.0) < 1e-6
    assert abs(float(p.grad.norm()) - 1.0) < 1e-5
