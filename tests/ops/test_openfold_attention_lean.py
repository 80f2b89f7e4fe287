"""The planned eager Triton path of OpenFold's attention (apex.ops._openfold_attention_direct, taken by
``attention``, ``AttnTri``, ``AttnBiasJIT`` and ``AttnNoBiasJIT``): the same bits and launches as the general path
for every layout it plans, the general path's errors after a warm call, and the general path where it must run
(no plan, modes, torch.func, another backend, double backward), and saved-tensor hooks that change a layout."""

from __future__ import annotations

import pytest
import torch

import apex
from apex.contrib.openfold_triton import AttnBiasJIT, AttnTri
from apex.ops import openfold_attention as OA
from tests import _device
from tests.ops._lean import record_launches, same_run

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the general path by design")

LEAN, GENERAL = "_DirectOpenFoldAttentionBackward", "_AttentionTritonBackward"


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)


def _run(q, k, v, mask, bias, do, inf=1e9):
    """Output and the gradients of every leaf that requires one."""
    o = AttnTri(q, k, v, mask, bias, inf)
    leaves = [t for t in (q, k, v, bias) if t is not None and t.requires_grad]
    return o, (list(torch.autograd.grad(o, leaves, do)) if leaves else [])


def _both(monkeypatch, q, k, v, mask, bias, do, inf=1e9):
    lean = _run(_leaf(q), _leaf(k), _leaf(v), mask, _leaf(bias), do, inf)
    with monkeypatch.context() as m:
        m.setattr(OA, "_lean", lambda *args: None)
        general = _run(_leaf(q), _leaf(k), _leaf(v), mask, _leaf(bias), do, inf)
    return lean, general


def _inputs(case, dtype, dev, b=2, h=2, n=8, d=8):
    """OpenFold's layout ``[1, B, H, N, D]`` with a ``[1, B, 1, 1, N]`` mask and a ``[1, 1, H, N, N]`` bias; or 4-D
    with a transposed (strided) value and a full-size bias."""
    if case == "4d":
        q, k = (torch.randn(b, h, n, d, device=dev).to(dtype) for _ in range(2))
        v = torch.randn(b, n, h, d, device=dev).to(dtype).transpose(1, 2)
        mask = (torch.rand(b, 1, 1, n, device=dev) > 0.3).to(dtype)
        bias = torch.randn(b, h, n, n, device=dev).to(dtype)
    else:
        q, k, v = (torch.randn(1, b, h, n, d, device=dev).to(dtype) for _ in range(3))
        mask = (torch.rand(1, b, 1, 1, n, device=dev) > 0.3).to(dtype)
        bias = torch.randn(1, 1, h, n, n, device=dev).to(dtype)
    mask[..., 0] = 1.0  # no fully masked row
    mask = None if case in ("plain", "bias") else mask
    bias = None if case in ("plain", "mask") else bias.requires_grad_()
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask, bias


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("case,dtype", [("plain", F32), ("plain", BF16), ("mask", F16), ("bias", BF16),
                                        ("mask-bias", F16), ("4d", F32)], ids=str)
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, dtype, case):
    for bias_grad in (True, False):  # a miss, then a hit (fresh values); the bias's gradient, then none
        q, k, v, mask, bias = _inputs(case, dtype, triton_device)
        if bias is not None:
            bias.requires_grad_(bias_grad)
        do = torch.randn(q.shape, device=triton_device).to(dtype)
        with apex.backend("triton"):
            lean, general = _both(monkeypatch, q, k, v, mask, bias, do)
            assert type(lean[0].grad_fn).__name__ == LEAN and type(general[0].grad_fn).__name__ == GENERAL
            same_run(lean, general)
            if bias_grad:
                continue
            with torch.no_grad():  # the plan's forward alone
                o = AttnBiasJIT(q, k, v, mask, bias, 1e9)
                with monkeypatch.context() as m:
                    m.setattr(OA, "_lean", lambda *args: None)
                    same_run((o, []), (AttnBiasJIT(q, k, v, mask, bias, 1e9), []))


def test_launches_are_the_general_paths(triton_device, monkeypatch):
    from apex._kernels import openfold_attention as K

    q, k, v, mask, bias = _inputs("4d", torch.float32, triton_device)
    do = torch.randn(q.shape, device=triton_device)
    if type(K._attn_fwd).__name__ == "InterpretedFunction" and "run" not in vars(type(K._attn_fwd)):
        pytest.skip("Triton 3.4's interpreter launches a kept launcher past its run method: nothing to record")
    kernels = [K._attn_fwd, K._attn_bwd_dq, K._attn_bwd_dkdv]
    with apex.backend("triton"):
        _run(q, k, v, mask, bias, do)  # warm
        got = record_launches(monkeypatch, kernels)
        _run(q, k, v, mask, bias, do)
        _run(q, k, v, mask, bias.detach(), do)  # no score gradient
        with monkeypatch.context() as m:
            m.setattr(OA, "_lean", lambda *args: None)
            want = record_launches(m, kernels)
            _run(q, k, v, mask, bias, do)
            _run(q, k, v, mask, bias.detach(), do)
    assert len(got) == 6 and got == want


def test_a_hit_runs_no_general_code(triton_device, monkeypatch):
    q, k, v, mask, bias = _inputs("mask-bias", torch.float32, triton_device)
    do = torch.randn(q.shape, device=triton_device)
    with apex.backend("triton"):
        ref = _run(q, k, v, mask, bias, do)

        def refuse(*args, **kwargs):
            raise AssertionError("the general path ran on a planned call")

        lean = OA._lean.__self__
        with monkeypatch.context() as m:
            for name in ("check_args", "_operands", "_triton_forward", "_triton_backward", "_attention_torch",
                         "general"):
                m.setattr(OA, name, refuse)
            m.setattr(OA._AttentionTriton, "forward", staticmethod(refuse))
            m.setattr(lean, "check", refuse)
            m.setattr(lean, "operands", refuse)
            m.setattr(lean, "general", refuse)
            got = _run(q, k, v, mask, bias, do)
    same_run(got, ref)


def test_a_bad_call_after_a_warm_one_still_raises(triton_device, monkeypatch):
    dev = triton_device
    q, k, v, mask, bias = _inputs("mask-bias", torch.float32, dev)
    with apex.backend("triton"):
        AttnTri(q, k, v, mask, bias, 1e9)
        AttnTri(q, k, v, mask, bias, 1e9)  # a hit
        with pytest.raises(ValueError, match="key and value must have the same shape"):
            AttnTri(q, k, v[..., :4, :], mask, bias, 1e9)
        with pytest.raises(TypeError, match="query, key and value must share a dtype"):
            AttnTri(q, k.half(), v, mask, bias, 1e9)
        with pytest.raises(ValueError, match="bias of shape"):
            AttnTri(q, k, v, mask, bias[..., :4], 1e9)
        with pytest.raises(ValueError, match="mask is on meta"):
            AttnTri(q, k, v, mask.to("meta"), bias, 1e9)
        with pytest.raises(ValueError, match="inf must be a positive number"):
            AttnTri(q, k, v, mask, bias, -1.0)
        with pytest.raises(TypeError, match="query must be a tensor"):
            AttnTri("q", k, v, mask, bias, 1e9)
        # An int inf (never planned: the general path converts it): its results.
        do = torch.randn(q.shape, device=dev)
        same_run(*_both(monkeypatch, q, k, v, mask, bias, do, inf=10 ** 9))
        o = AttnTri(q, k, v, mask, bias, 1e9)  # the plan is still there
        assert type(o.grad_fn).__name__ == LEAN


def test_unplanned_layouts_take_the_general_path(triton_device, monkeypatch):
    """A bool mask (converted), leading dims that do not merge (copied) and fp64 (PyTorch's path) are kept as
    False, with the general path's results."""
    dev = triton_device
    plans = OA._lean.__self__.table.plans
    q, k, v, mask, bias = _inputs("mask", torch.float32, dev)
    unmerged = torch.randn(3, 2, 2, 8, 8, device=dev).transpose(0, 1).requires_grad_()  # leading dims: no one stride
    with apex.backend("triton"):
        for args in ((q, k, v, mask > 0.5, None), (unmerged, unmerged, unmerged, None, None),
                     tuple(None if t is None else t.detach().double().requires_grad_(t.requires_grad)
                           for t in (q, k, v, mask, bias))):
            plans.clear()
            lean, general = _both(monkeypatch, *args, torch.ones_like(args[0]))
            assert type(lean[0].grad_fn).__name__ != LEAN
            same_run(lean, general)
            assert list(plans.values()) == [False]


def test_a_mask_alone_requiring_a_gradient_records_no_graph(triton_device):
    q, k, v, mask, _ = _inputs("mask", torch.float32, triton_device)
    q, k, v = q.detach(), k.detach(), v.detach()
    with apex.backend("triton"):
        o = AttnTri(q, k, v, mask.requires_grad_(), None, 1e9)
    assert o.grad_fn is None and not o.requires_grad


def test_backward_of_saved_tensors_with_other_strides(triton_device):
    """A saved-tensor hook that gives the operands back in another layout: the backward reads them with their own
    strides (the same gradients as without the hook)."""
    q, k, v, mask, bias = _inputs("mask-bias", torch.float32, triton_device)
    do = torch.randn(q.shape, device=triton_device)
    with apex.backend("triton"):
        ref = _run(q, k, v, mask, bias, do)

    def pack(t):  # q, k, v in another memory order (same values)
        return t.detach().transpose(-1, -2).contiguous().transpose(-1, -2) if t.shape == q.shape else t

    with apex.backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = AttnTri(q, k, v, mask, bias, 1e9)
    assert type(o.grad_fn).__name__ == LEAN
    with apex.backend("triton"):
        got = (o, list(torch.autograd.grad(o, (q, k, v, bias), do)))
    same_run(got, ref)


def test_another_backend_mode_or_transform_takes_the_general_path(triton_device):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v, mask, _ = _inputs("mask", torch.float32, triton_device)
    with apex.backend("triton"):
        ref = AttnTri(q, k, v, mask, None, 1e9)
        assert type(ref.grad_fn).__name__ == LEAN
        with Passthrough():
            o = AttnTri(q, k, v, mask, None, 1e9)
        assert type(o.grad_fn).__name__ == GENERAL
        torch.testing.assert_close(o, ref, rtol=0, atol=0)
        seen = []

        def f(t):  # under a torch.func transform the lean path declines
            seen.append(OA._lean(t, k.detach(), v.detach(), mask, None, 1e9))
            return t.sum()

        torch.func.grad(f)(q.detach())
        assert seen == [None]
    with apex.backend("torch"):  # another backend: the general path (PyTorch's), then the plan again
        assert type(AttnTri(q, k, v, mask, None, 1e9).grad_fn).__name__ not in (LEAN, GENERAL)
    with apex.backend("triton"):
        assert type(AttnTri(q, k, v, mask, None, 1e9).grad_fn).__name__ == LEAN


def test_double_backward_fails_as_the_general_path_does(triton_device, monkeypatch):
    q, k, v, mask, _ = _inputs("mask", torch.float32, triton_device)

    def second(lean):
        with monkeypatch.context() as m:
            if not lean:
                m.setattr(OA, "_lean", lambda *args: None)
            o = AttnTri(q, k, v, mask, None, 1e9)
            try:
                gq, = torch.autograd.grad(o.square().sum(), q, create_graph=True)
                gq.sum().backward()
            except Exception as exc:  # noqa: BLE001 (the same error either way)
                return type(exc), str(exc)[:80]
            return None, q.grad.clone()

    with apex.backend("triton"):
        a, b = second(True), second(False)
    assert a[0] is b[0] and (a[0] is None or a[1] == b[1])


def test_an_invalidation_between_forward_and_backward(triton_device, monkeypatch):
    from apex._kernels import _tuning

    q, k, v, mask, bias = _inputs("mask-bias", torch.float16, triton_device)
    do = torch.randn(q.shape, device=triton_device).half()
    with apex.backend("triton"):
        _, ref = _both(monkeypatch, q, k, v, mask, bias, do)
        o = AttnTri(q, k, v, mask, bias, 1e9)
        _tuning.invalidate()
        got = torch.autograd.grad(o, (q, k, v, bias), do)
    same_run((o, list(got)), ref)


@pytest.mark.parametrize("case", ["mask-bias", "4d"])
def test_general_backward_of_saved_tensors_with_other_layouts(triton_device, monkeypatch, case):
    """The general path's backward under a saved-tensor hook that gives its operands back in another layout (an
    expanded mask made dense, as save_on_cpu does; q, k, v in another memory order): the same gradients."""
    q, k, v, mask, bias = _inputs(case, torch.float32, triton_device)
    do = torch.randn(q.shape, device=triton_device)
    monkeypatch.setattr(OA, "_lean", lambda *args: None)
    with apex.backend("triton"):
        ref = _run(q, k, v, mask, bias, do)

    def unpack(t):
        if t.dim() >= 4 and t.shape[-1] > 1:
            return t.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values in another memory order
        return t.contiguous()

    with apex.backend("triton"), torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), unpack):
        o = AttnTri(q, k, v, mask if mask is None else mask.expand(q.shape[:-1] + (k.shape[-2],)), bias, 1e9)
        assert type(o.grad_fn).__name__ == GENERAL
        got = (o, list(torch.autograd.grad(o, [t for t in (q, k, v, bias) if t is not None and t.requires_grad],
                                           do)))
    same_run(got, ref)
