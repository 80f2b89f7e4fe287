"""Apex's O1 function lists (``apex.amp.lists``): their contents, and a user's edits made before O1 starts
(as NVIDIA's Tacotron 2 recipe does with softmax) changing what O1 runs in which precision."""

import copy

import pytest
import torch
import torch.nn.functional as F

from apex import amp
from apex.amp.lists import functional_overrides as fo
from apex.amp.lists import tensor_overrides as te
from apex.amp.lists import torch_overrides as to

_LIST_NAMES = ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS")


@pytest.fixture
def lists():
    """The three list modules, restored to their contents after the test; O1 switched off after it."""
    saved = {m: {n: copy.copy(getattr(m, n)) for n in _LIST_NAMES} for m in (fo, to, te)}
    banned = list(fo.BANNED_FUNCS)
    yield fo, to, te
    amp.frontend._reset_casting()
    _KEEP.clear()
    for m, values in saved.items():
        for n, v in values.items():
            getattr(m, n)[:] = v
    fo.BANNED_FUNCS[:] = banned


_KEEP: list = []  # O1 casting lasts while its models live


def _o1(half=torch.bfloat16):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = amp.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0)
    _KEEP[:] = [model]
    return model(torch.randn(3, 4))  # a half activation


def test_lists_have_apexs_names_and_contents():
    assert amp.lists.functional_overrides is fo and fo.MODULE is F and to.MODULE is torch and te.MODULE is torch.Tensor
    assert {"softmax", "layer_norm", "cross_entropy", "gelu"} <= set(fo.FP32_FUNCS)
    assert {"linear", "conv2d"} <= set(fo.FP16_FUNCS)
    assert {"exp", "log", "pow", "sum", "norm"} <= set(to.FP32_FUNCS) and "mean" not in to.FP32_FUNCS
    assert {"mm", "matmul", "addmm", "prelu"} <= set(to.FP16_FUNCS)
    assert to.SEQUENCE_CASTS == ["cat", "stack"] and {"add", "addcmul", "eq"} <= set(to.CASTS)
    assert fo.BANNED_FUNCS[0][0] == "binary_cross_entropy" and "allow_banned" in fo.BANNED_FUNCS[0][1]
    # the Tensor lists: their own entries, then every torch entry that is also a Tensor method
    assert te.FP16_FUNCS[0] == "__matmul__" and {"mm", "matmul"} <= set(te.FP16_FUNCS)
    assert {"__pow__", "cpu", "exp", "sum"} <= set(te.FP32_FUNCS) and "conv2d" not in te.FP16_FUNCS
    assert all(hasattr(torch.Tensor, n) for name in _LIST_NAMES for n in getattr(te, name))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
def test_softmax_moved_to_fp16_runs_in_half(lists, half):
    # NVIDIA DeepLearningExamples' Tacotron 2: softmax off the fp32 list, onto the fp16 one, before O1.
    fo.FP32_FUNCS.remove("softmax")
    fo.FP16_FUNCS.append("softmax")
    h = _o1(half)
    assert h.dtype == half
    out = F.softmax(h, dim=-1)
    assert out.dtype == half
    torch.testing.assert_close(out, torch.softmax(h.float(), -1).to(half))
    assert F.softmax(h.float(), dim=-1).dtype == half  # fp32 arguments are cast down, as Apex's wrapper did
    assert F.log_softmax(h, -1).dtype == torch.float32  # the rest of the list is as shipped
    amp.frontend._reset_casting()
    assert not hasattr(F.softmax, "__wrapped_amp__") and F.softmax(h, -1).dtype == half


def test_moved_function_runs_with_autocast_off(lists):
    # mse_loss is on CPU autocast's own fp32 list: moved to FP16_FUNCS, it must still run in half.
    fo.FP32_FUNCS.remove("mse_loss")
    fo.FP16_FUNCS.append("mse_loss")
    h = _o1()
    assert F.mse_loss(h, torch.zeros(3, 4)).dtype == torch.bfloat16


def test_added_fp32_and_removed_names(lists):
    to.FP32_FUNCS.append("relu")      # torch.relu: fp32 now
    fo.FP32_FUNCS.remove("layer_norm")  # on no list: runs on its arguments as they come
    h = _o1()
    assert torch.relu(h).dtype == torch.float32 and torch.relu(h.float()).dtype == torch.float32
    assert F.layer_norm(h, (4,)).dtype == torch.bfloat16
    with amp.disable_casts():
        assert torch.relu(h).dtype == torch.bfloat16


def test_added_casts_promote_mixed_arguments(lists):
    h = _o1()
    with pytest.raises(RuntimeError, match="expected dtype"):
        torch.lerp(h, torch.randn(3, 4), 0.5)
    amp.frontend._reset_casting()
    to.CASTS.append("lerp")
    h = _o1()
    assert torch.lerp(h, torch.randn(3, 4), 0.5).dtype == torch.float32


def test_added_banned_function_raises_on_half(lists):
    fo.BANNED_FUNCS.append(("hardtanh", "hardtanh is not for half inputs here"))
    h = _o1()
    with pytest.raises(NotImplementedError, match="hardtanh is not for half"):
        F.hardtanh(h)
    assert F.hardtanh(h.float()).dtype == torch.float32
    amp.frontend._reset_casting()
    h = torch.randn(3, 4).bfloat16()
    assert F.hardtanh(h).dtype == torch.bfloat16


def test_cpu_transfer_rule_follows_the_tensor_list(lists):
    h = _o1()
    assert h.cpu().dtype == torch.float32  # Apex's rule: a half tensor reaches the host in fp32
    amp.frontend._reset_casting()
    te.FP32_FUNCS.remove("cpu")
    h = _o1()
    assert h.cpu().dtype == torch.bfloat16
