"""Apex's legacy ``apex.contrib.optimizers.FusedSGD``: SGD for ``apex.contrib.optimizers.FP16_Optimizer``.

The optimizer's parameters are the fp32 master weights; ``step`` must be given the gradients (``grads``)
and the model's weights (``output_params``, fp32 or fp16/bf16), one per master parameter, flat for one
group or as a list of per-group lists. For every parameter, in fp32 (``apex.ops.multi_tensor_sgd``)::

    g = grad / scale  (+ weight_decay * w unless wd_after_momentum)
    buf = g on the first step, else momentum * buf + (1 - dampening) * g
    g = g + momentum * buf (nesterov) or buf  (+ weight_decay * w if wd_after_momentum)
    w = w - lr * g ;  the model weight receives w when it is reduced precision

(the velocity form ``v = rho * v + g; p = p - lr * v`` of ``torch.optim.SGD``). ``materialize_master_grads``
is accepted for Apex's signature; it has no effect here, as in Apex. Using it under ``apex.amp`` or without
``grads``/``output_params`` raises ``RuntimeError``, as in Apex.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from apex.contrib.optimizers.fused_adam import _per_group
from apex.ops.multi_tensor_sgd import multi_tensor_sgd


class FusedSGD(torch.optim.Optimizer):
    """SGD with momentum over fp32 masters and reduced-precision model copies (see the module docstring)."""

    def __init__(self, params, lr=required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True):
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def get_momentums(self, params):
        """Momentum buffers for ``params`` (created as zeros) and whether this is their first step."""
        momentums, first_run = [], True
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                first_run = True
                state["momentum_buffer"] = torch.zeros_like(p)
            else:
                first_run = False
            momentums.append(state["momentum_buffer"])
        return momentums, first_run

    def step(self, closure=None, grads=None, output_params=None, scale: float = 1.0, grad_norms=None):
        """One step with the gradients ``grads`` (divided by ``scale``), writing the model weights
        ``output_params``; ``grad_norms`` is accepted and unused, as in Apex."""
        if hasattr(self, "_amp_stash"):
            raise RuntimeError("apex.contrib.optimizers.FusedSGD should not be used with AMP.")
        if grads is None:
            raise RuntimeError("apex.contrib.optimizers.FusedSGD must be wrapped with "
                               "apex.contrib.optimizers.FP16_Optimizer which provides grads.")
        if output_params is None:
            raise RuntimeError("apex.contrib.optimizers.FusedSGD must be wrapped with "
                               "apex.contrib.optimizers.FP16_Optimizer which provides output_params.")
        n = len(self.param_groups)
        grads_group = _per_group(grads, n, "grads")
        outputs_group = _per_group(output_params, n, "output_params")
        if len(grads_group) != n or len(outputs_group) != n:
            raise ValueError(f"grads and output_params must cover all {n} parameter groups")
        for group, g_list, o_list in zip(self.param_groups, grads_group, outputs_group):
            if len(g_list) != len(group["params"]) or len(o_list) != len(group["params"]) or \
                    any(g is None for g in g_list) or any(o is None for o in o_list):
                raise RuntimeError("apex.contrib.optimizers.FusedSGD only works when all parameters require grad.")
            for o in o_list:
                if o.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise TypeError(f"output_params must be fp32, fp16 or bf16, got {o.dtype}")

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, g_list, o_list in zip(self.param_groups, grads_group, outputs_group):
            masters = group["params"]
            # fp32 model weights are the masters themselves; reduced-precision ones get a copy written
            full = [i for i, o in enumerate(o_list) if o.dtype == torch.float32]
            reduced = [i for i, o in enumerate(o_list) if o.dtype != torch.float32]
            for idx, with_copy in ((reduced, True), (full, False)):
                if not idx:
                    continue
                params = [masters[i] for i in idx]
                momentums, first_run = self.get_momentums(params)
                lists = [[g_list[i] for i in idx], [p.data for p in params], momentums]
                if with_copy:
                    lists.append([o_list[i] for i in idx])
                multi_tensor_sgd(2048 * 32, torch.zeros(1, dtype=torch.int32, device=params[0].device), lists,
                                 group["weight_decay"], group["momentum"], group["dampening"], group["lr"],
                                 group["nesterov"], first_run, self.wd_after_momentum, 1.0 / scale)
        return loss
