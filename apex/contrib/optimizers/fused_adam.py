"""Apex's legacy ``apex.contrib.optimizers.FusedAdam`` (the pre-``apex.optimizers`` API, used with
``apex.contrib.optimizers.FP16_Optimizer`` and fairseq's ``FusedAdamV1``).

The update is ``fused_adam_cuda.adam`` (``apex.ops.legacy_adam``)::

    g = grad / combined_scale
    m = beta1 * m + (1 - beta1) * g ;  v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v + eps) if eps_inside_sqrt else sqrt(v) + eps
    p = p - lr * sqrt(1 - beta2**t) / (1 - beta1**t) * (m / denom + weight_decay * p)

``combined_scale = scale``, times ``((grad_norm / scale) + 1e-6) / max_grad_norm`` when ``max_grad_norm > 0``
and that factor exceeds 1 (``grad_norm`` is the norm of the *scaled* gradients, as FP16_Optimizer passes it).
The step takes ``grads`` (e.g. fp16 gradients for fp32 master parameters) and ``output_params`` (a reduced
precision copy written with the new values) per parameter, or per group as lists of lists.

State (``exp_avg``, ``exp_avg_sq``) has the parameter's dtype; the math runs in fp32 (fp64 for fp64
parameters). ``use_mt`` selects the multi-tensor entry point (same results). Differences from Apex: bad
hyper-parameters raise ``ValueError``; ``max_grad_norm > 0`` without ``grad_norms`` raises ``ValueError``.
"""

from __future__ import annotations

import types

import torch

from apex.ops import legacy_adam


def _per_group(value, n_groups: int, name: str) -> list:
    """Apex's convention: None, a flat list/generator (one group), or a list of per-group lists."""
    if value is None:
        return [None] * n_groups
    if isinstance(value, types.GeneratorType):
        return [list(value)]
    value = list(value)
    if value and isinstance(value[0], (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(f"{name} has {len(value)} groups but the optimizer has {n_groups}")
        return [list(v) for v in value]
    return [value]


class FusedAdam(torch.optim.Optimizer):
    """Adam with Apex's legacy update and step signature (see the module docstring)."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False, use_mt: bool = False,
                 amp_scale_adjustment: float = 1.0):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas} (expected two values in [0, 1))")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not max_grad_norm >= 0.0:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self._use_multi_tensor = bool(use_mt)
        self._amp_scale_adjustment = amp_scale_adjustment
        self.eps_mode = 0 if eps_inside_sqrt else 1

    def step(self, closure=None, grads=None, output_params=None, scale: float = 1.0, grad_norms=None):
        """One step. ``grads``/``output_params``: per-parameter gradients to use and reduced-precision
        copies to write (flat list for one group, or list of lists); ``scale``: the loss scale to divide the
        gradients by; ``grad_norms``: per-group norms of the scaled gradients (for ``max_grad_norm``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if hasattr(self, "_amp_stash"):
            grads = self._amp_stash.grads
            output_params = self._amp_stash.output_params
            scale = self._amp_stash.scale * self._amp_scale_adjustment
            grad_norms = self._amp_stash.grad_norms

        n = len(self.param_groups)
        grads_group = _per_group(grads, n, "grads")
        outputs_group = _per_group(output_params, n, "output_params")
        norms = [None] * n if grad_norms is None else list(grad_norms)
        plans = []
        # validate everything before touching any state ("bad input changes nothing")
        for group, g_list, o_list, norm in zip(self.param_groups, grads_group, outputs_group, norms):
            params = group["params"]
            g_list = [None] * len(params) if g_list is None else g_list
            o_list = [None] * len(params) if o_list is None else o_list
            if len(g_list) != len(params) or len(o_list) != len(params):
                raise ValueError("grads and output_params must have one entry per parameter of the group")
            combined_scale = float(scale)
            if group["max_grad_norm"] > 0:
                if norm is None:
                    raise ValueError("grad_norms is required when max_grad_norm > 0")
                clip = ((float(norm) / float(scale)) + 1e-6) / group["max_grad_norm"]
                if clip > 1:
                    combined_scale = clip * float(scale)
            items = []
            for p, g, out in zip(params, g_list, o_list):
                if g is None:
                    if p.grad is None:
                        continue
                    g = p.grad
                if g.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients, "
                                       "please consider SparseAdam instead")
                if g.numel() != p.numel() or (out is not None and out.numel() != p.numel()):
                    raise ValueError("grads and output_params must have as many elements as their parameters")
                items.append((p, g, out))
            plans.append((group, items, combined_scale))

        for group, items, combined_scale in plans:
            beta1, beta2 = group["betas"]
            bias_correction = 1 if group["bias_correction"] else 0
            lists = [[], [], [], [], []]
            step = 0
            for p, g, out in items:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"]
                if self._use_multi_tensor:
                    for lst, t in zip(lists, (p, state["exp_avg"], state["exp_avg_sq"], g, out)):
                        lst.append(t)
                else:
                    copy = torch.empty(0, device=p.device) if out is None else out
                    legacy_adam.adam(p.data, copy, state["exp_avg"], state["exp_avg_sq"], g, group["lr"], beta1,
                                     beta2, group["eps"], combined_scale, step, self.eps_mode, bias_correction,
                                     group["weight_decay"])
            if self._use_multi_tensor and lists[0]:
                device = lists[0][0].device
                if any(t.device != device for t in lists[0]):
                    raise RuntimeError("FusedAdam does not support use_mt with tensors on multiple devices")
                flag = torch.zeros(1, dtype=torch.int32, device=device)
                with_copies = all(t is not None for t in lists[4])
                tensor_lists = [[p.data for p in lists[0]], *lists[1:4]] + ([lists[4]] if with_copies else [])
                legacy_adam.adam_mt(2048 * 32, flag, tensor_lists, group["lr"], beta1, beta2, group["eps"],
                                    combined_scale, step, self.eps_mode, bias_correction, group["weight_decay"])
                if not with_copies:  # only some parameters have a copy: write those after the update
                    for p, out in zip(lists[0], lists[4]):
                        if out is not None:
                            legacy_adam.maybe_cast(flag, p.data, out)
        return loss
