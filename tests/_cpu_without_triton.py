"""Every fused op's public entry, called on CPU tensors with the default backend where Triton cannot be
imported (``triton`` is an optional extra): run as a script by ``tests/test_architecture.py``; prints, as
JSON, the calls that failed and the Triton and kernel modules loaded."""

import json
import sys


def _calls() -> dict:
    import torch

    from apex.contrib.focal_loss.focal_loss import focal_loss
    from apex.contrib.group_norm import GroupNorm
    from apex.contrib.index_mul_2d import index_mul_2d
    from apex.contrib.openfold_triton import AttnTri, LayerNormSmallShapeOptImpl
    from apex.contrib.transducer import TransducerJoint, TransducerLoss
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
    from apex.fused_dense import FusedDense
    from apex.mlp import MLP
    from apex.normalization import FusedLayerNorm, FusedRMSNorm, fused_add_rms_norm
    from apex.parallel import SyncBatchNorm
    from apex.transformer.functional import (
        bias_gelu,
        bias_swiglu,
        fused_apply_rotary_pos_emb,
        scaled_masked_softmax,
        scaled_upper_triang_masked_softmax,
    )

    def r(*s):
        return torch.randn(*s, requires_grad=True)

    def i32(*v):
        return torch.tensor(v, dtype=torch.int32)

    def optimizers():
        from apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

        out = torch.zeros(())
        for cls in (FusedAdam, FusedLAMB, FusedSGD, FusedNovoGrad, FusedAdagrad):
            p = torch.nn.Parameter(torch.randn(8))
            opt = cls([p], lr=0.1)
            for _ in range(2):
                p.grad = torch.randn(8)
                opt.step()
            out = out + p.detach().sum()
        return out.requires_grad_()

    def amp_c():
        import amp_C

        xs, flag = [torch.randn(8), torch.randn(3)], torch.zeros(1, dtype=torch.int32)
        amp_C.multi_tensor_scale(2048 * 32, flag, [xs, [torch.empty_like(x) for x in xs]], 0.5)
        norm, _ = amp_C.multi_tensor_l2norm(2048 * 32, flag, [xs], False)
        return norm.requires_grad_()

    return {
        "FusedLayerNorm": lambda: FusedLayerNorm(8)(r(4, 8)),
        "FusedRMSNorm": lambda: FusedRMSNorm(8)(r(4, 8)),
        "fused_add_rms_norm": lambda: fused_add_rms_norm(r(4, 8), r(4, 8), r(8), (8,), 1e-5)[0],
        "bias_gelu": lambda: bias_gelu(r(4, 8), r(8)),
        "bias_swiglu": lambda: bias_swiglu(r(4, 8), r(8)),
        "fused_rope": lambda: fused_apply_rotary_pos_emb(r(4, 1, 2, 8), torch.randn(4, 1, 1, 8)),
        "causal softmax": lambda: scaled_upper_triang_masked_softmax(r(1, 2, 4, 4), None, 0.5),
        "masked softmax": lambda: scaled_masked_softmax(r(1, 2, 4, 4), torch.zeros(1, 1, 4, 4, dtype=torch.bool),
                                                        0.5),
        "xentropy": lambda: SoftmaxCrossEntropyLoss.apply(r(4, 8), torch.randint(0, 8, (4,)), 0.1, 0, False),
        "index_mul_2d": lambda: index_mul_2d(r(4, 8), r(3, 8), torch.tensor([0, 1, 2])),
        "GroupNorm": lambda: GroupNorm(2, 4)(r(2, 4, 3, 3)),
        "FusedDense": lambda: FusedDense(8, 8)(r(4, 8)),
        "MLP": lambda: MLP([8, 8, 8])(r(4, 8)),
        "focal_loss": lambda: focal_loss(r(4, 12), torch.randint(-2, 10, (4,)), torch.tensor([2.0]), 10, 0.25, 2.0),
        "TransducerJoint": lambda: TransducerJoint()(r(2, 3, 8), r(2, 2, 8), i32(3, 2), i32(2, 1)),
        "TransducerLoss": lambda: TransducerLoss()(r(2, 3, 3, 5), torch.randint(0, 4, (2, 2), dtype=torch.int32),
                                                   i32(3, 2), i32(2, 1), 4),
        "openfold LayerNorm": lambda: LayerNormSmallShapeOptImpl.apply(r(4, 8), (8,), r(8), r(8), 1e-5),
        "openfold attention": lambda: AttnTri(r(1, 2, 4, 3, 8), r(1, 2, 4, 3, 8), r(1, 2, 4, 3, 8), None, None, 1e9),
        "SyncBatchNorm": lambda: SyncBatchNorm(4)(r(2, 4, 3)),
        "optimizers": optimizers,
        "amp_C": amp_c,
    }


def main() -> None:
    sys.modules["triton"] = None  # as where the optional extra is not installed: importing it raises
    failed = {}
    for name, call in _calls().items():
        try:
            for _ in range(2):  # (a second call: a kept answer of the first must hold too)
                call().float().sum().backward()
        except Exception as e:  # noqa: BLE001 (every failure is reported)
            failed[name] = f"{type(e).__name__}: {e}"[:300]
    loaded = sorted(m for m, mod in sys.modules.items()
                    if mod is not None and (m == "triton" or m.startswith(("triton.", "apex._kernels."))))
    print(json.dumps({"failed": failed, "loaded": loaded}))


if __name__ == "__main__":
    main()
