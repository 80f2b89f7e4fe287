"""The ops :mod:`bench_op_host` times: each a builder returning ``(call, differentiable inputs)``, the call
made through the op's public entry (the module or function a model uses) at a small shape."""

from __future__ import annotations

from collections.abc import Callable

M, N = 16, 1024  # rows × row length of the row-wise ops: small, so the CPU's own operators cost little


def _randn(*shape, grad=True, dtype=None):
    import torch

    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _layer_norm():
    from apex.normalization import FusedLayerNorm

    mod, x = FusedLayerNorm(N), _randn(M, N)
    return (lambda: mod(x)), (x, mod.weight, mod.bias)


def _rms_norm():
    from apex.normalization import FusedRMSNorm

    mod, x = FusedRMSNorm(N), _randn(M, N)
    return (lambda: mod(x)), (x, mod.weight)


def _fused_add_rms_norm():
    from apex.normalization import fused_add_rms_norm

    x, r, w = _randn(M, N), _randn(M, N), _randn(N)
    return (lambda: fused_add_rms_norm(x, r, w, (N,), 1e-5)[0]), (x, r, w)


def _fused_rope():
    from apex.transformer.functional import fused_apply_rotary_pos_emb

    t, freqs = _randn(8, 2, 4, 64), _randn(8, 1, 1, 64, grad=False)
    return (lambda: fused_apply_rotary_pos_emb(t, freqs)), (t,)


def _xentropy():
    import torch

    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    x, labels = _randn(M, N), torch.randint(1, N, (M,))
    return (lambda: SoftmaxCrossEntropyLoss.apply(x, labels, 0.1, 0, True)), (x,)


def _causal_softmax():
    from apex.transformer.functional import scaled_upper_triang_masked_softmax

    x = _randn(2, 4, 32, 32)
    return (lambda: scaled_upper_triang_masked_softmax(x, None, 0.125)), (x,)


def _masked_softmax():
    import torch

    from apex.transformer.functional import scaled_masked_softmax

    x, mask = _randn(2, 4, 32, 32), torch.zeros(2, 1, 32, 32, dtype=torch.bool)
    return (lambda: scaled_masked_softmax(x, mask, 0.125)), (x,)


def _bias_swiglu():
    from apex.transformer.functional import bias_swiglu

    x, b = _randn(M, 2 * N), _randn(2 * N)
    return (lambda: bias_swiglu(x, b)), (x, b)


def _bias_gelu():
    from apex.transformer.functional import bias_gelu

    x, b = _randn(M, N), _randn(N)
    return (lambda: bias_gelu(x, b)), (x, b)


def _fused_dense():
    from apex.fused_dense import FusedDense

    mod, x = FusedDense(64, 64), _randn(M, 64)
    return (lambda: mod(x)), (x, mod.weight, mod.bias)


def _mlp():
    from apex.mlp import MLP

    mod, x = MLP([64, 64, 64]), _randn(M, 64)
    return (lambda: mod(x)), (x, *mod.parameters())


def _group_norm():
    import torch

    from apex.ops.group_norm import group_norm

    x, w, b = _randn(2, 64, 4, 4).to(memory_format=torch.channels_last).detach().requires_grad_(), _randn(64), \
        _randn(64)
    return (lambda: group_norm(x, 8, w, b, 1e-5)), (x, w, b)


def _focal_loss():
    import torch

    from apex.contrib.focal_loss.focal_loss import focal_loss

    x, y, npos = _randn(M, 96), torch.randint(-2, 80, (M,)), torch.tensor([4.0])
    return (lambda: focal_loss(x, y, npos, 80, 0.25, 2.0)), (x,)


def _index_mul_2d():
    import torch

    from apex.contrib.index_mul_2d import index_mul_2d

    a, b, idx = _randn(32, 64), _randn(M, 64), torch.randint(0, 32, (M,))
    return (lambda: index_mul_2d(a, b, idx)), (a, b)


def _transducer_joint():
    import torch

    from apex.contrib.transducer import TransducerJoint

    mod = TransducerJoint()
    f, g = _randn(2, 8, 64), _randn(2, 4, 64)
    fl, gl = torch.tensor([8, 6], dtype=torch.int32), torch.tensor([4, 3], dtype=torch.int32)
    return (lambda: mod(f, g, fl, gl)), (f, g)


def _transducer_loss():
    import torch

    from apex.contrib.transducer import TransducerLoss

    mod = TransducerLoss()
    x = _randn(2, 8, 4, 16)
    label = torch.randint(0, 15, (2, 3), dtype=torch.int32)
    fl, yl = torch.tensor([8, 6], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    return (lambda: mod(x, label, fl, yl, 15)), (x,)


def _wgrad_accum():
    import torch

    from apex.transformer.functional import wgrad_gemm_accum_fp32

    inp, go, main_grad = torch.randn(M, 64), torch.randn(M, 32), torch.zeros(32, 64)
    return (lambda: wgrad_gemm_accum_fp32(inp, go, main_grad)), None


def _sync_batch_norm():
    from apex.parallel import SyncBatchNorm

    mod, x = SyncBatchNorm(64), _randn(4, 64, 4, 4)
    return (lambda: mod(x)), (x, mod.weight, mod.bias)


def _openfold_layer_norm():
    from apex.contrib.openfold_triton import LayerNormSmallShapeOptImpl

    x, w, b = _randn(M, 128), _randn(128), _randn(128)
    return (lambda: LayerNormSmallShapeOptImpl.apply(x, (128,), w, b, 1e-5)), (x, w, b)


def _openfold_attention():
    from apex.contrib.openfold_triton import AttnTri

    q, k, v = (_randn(1, 2, 4, 16, 32) for _ in range(3))
    return (lambda: AttnTri(q, k, v, None, None, 1e9)), (q, k, v)


def _liger(kind: str):
    def build():
        if kind == "layer":
            from liger_kernel.transformers.layer_norm import LigerLayerNorm as Cls
        else:
            from liger_kernel.transformers.rms_norm import LigerRMSNorm as Cls
        mod, x = Cls(N), _randn(M, N)
        return (lambda: mod(x)), (x, *mod.parameters())
    return build


# Ops whose public entry is an ``nn.Module`` (Apex's API): the module call itself (hook checks, the
# forward's frame) costs them what a Function called directly does not; the ``same-job module`` reference
# pays it too.
MODULE_ENTRIES = {"FusedLayerNorm", "FusedRMSNorm", "FusedDense", "MLP", "transducer_joint", "transducer_loss",
                  "SyncBatchNorm", "liger LayerNorm", "liger RMSNorm"}

# Ops whose call makes more than one output (the timed call differentiates the first): the same-job reference
# returns as many (fused add + norm: the normalised output and the sum ``h``).
OUTPUTS = {"fused_add_rms_norm": 2}

OPS: dict[str, Callable] = {
    "FusedLayerNorm": _layer_norm,
    "FusedRMSNorm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "fused_rope": _fused_rope,
    "xentropy": _xentropy,
    "causal softmax": _causal_softmax,
    "masked softmax": _masked_softmax,
    "bias_swiglu": _bias_swiglu,
    "bias_gelu": _bias_gelu,
    "FusedDense": _fused_dense,
    "MLP": _mlp,
    "group_norm": _group_norm,
    "focal_loss": _focal_loss,
    "index_mul_2d": _index_mul_2d,
    "transducer_joint": _transducer_joint,
    "transducer_loss": _transducer_loss,
    "wgrad_accum": _wgrad_accum,
    "SyncBatchNorm": _sync_batch_norm,
    "openfold LayerNorm": _openfold_layer_norm,
    "openfold attention": _openfold_attention,
}
