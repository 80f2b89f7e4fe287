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
