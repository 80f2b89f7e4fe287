"""``FusedAdagrad``: Adagrad with one multi-tensor update per (device, dtype) group."""

from __future__ import annotations

import torch

from apex.optimizers._base import FusedOptimizerBase, check_non_negative, fused_step, group_by, trusted
from apex.optimizers._plan import Bucket, Plan, take


class FusedAdagrad(FusedOptimizerBase):
    r"""Adagrad, Apex's ``FusedAdagrad``; a drop-in replacement for ``torch.optim.Adagrad``.

    ::

        L2 (adagrad_w_mode=False):  g = g + weight_decay * p ;  sum += g² ;  p -= lr * g / (sqrt(sum) + eps)
        decoupled (adagrad_w_mode=True):  sum += g² ;  p -= lr * (g / (sqrt(sum) + eps) + weight_decay * p)

    Arithmetic is fp32; ``sum`` has the parameter's dtype (as in Apex and PyTorch). The state uses
    PyTorch's keys (``sum``, ``step``), so checkpoints move to and from ``torch.optim.Adagrad``.

    Arguments are Apex's: ``params, lr=1e-2, eps=1e-10, weight_decay=0., set_grad_none=True,
    adagrad_w_mode=False``.
    """

    _name = "FusedAdagrad"

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False):
        check_non_negative(lr, "lr")
        check_non_negative(eps, "eps")
        check_non_negative(weight_decay, "weight_decay")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=0.0, initial_accumulator_value=0.0,
                        foreach=None, maximize=False, differentiable=False, fused=None)
        super().__init__(params, defaults, set_grad_none=set_grad_none)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0

        import amp_C

        self.multi_tensor_adagrad = amp_C.multi_tensor_adagrad

    @fused_step
    def step(self, closure=None, grad_scaler=None):
        """Perform one update. ``closure`` re-evaluates the model and returns the loss. ``grad_scaler``: the
        ``torch.amp.GradScaler`` whose scale the gradients carry (what ``GradScaler.step`` passes): the step
        is skipped when a gradient is not finite, else the gradients are unscaled first."""
        loss = self._run_closure(closure)
        planned = self._step_plans()
        if self._unscale_or_skip(grad_scaler, planned):
            return loss
        for group, (plan, gs, gptrs) in zip(self.param_groups, planned):
            if not plan.buckets:
                continue
            plan.step_host += 1.0  # a NumPy view of the CPU counters: no PyTorch op per step
            for b in plan.buckets:
                self.multi_tensor_adagrad(2048 * 32, self._overflow_buf(b.device), [b.grads(gs, gptrs)] + b.lists,
                                          group["lr"], group["eps"], self.adagrad_w_mode, group["weight_decay"],
                                          **trusted(self.multi_tensor_adagrad))
        return loss

    def _build_plan(self, group: dict, checked) -> Plan:
        """State (``sum``, ``step`` packed into one buffer) and one bucket per dtype."""
        params = checked.params
        plan = Plan(group["params"], params)
        if not params:
            return plan
        states = []
        for p in params:
            state = self.state[p]
            if "sum" not in state:
                state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            states.append(state)
        plan.step_buf, _ = self._pack_steps(states, torch.device("cpu"))
        plan.watch(plan.step_buf)
        plan.step_host = plan.step_buf.numpy()
        device = params[0].device
        for dtype, idx in group_by(plan.dtypes, len(params)).items():
            sel = None if len(idx) == len(params) else idx
            b = Bucket(sel, dtype, device, tuple(take(plan.numels, sel)))
            b.lists = [b.column(take(params, sel), take(plan.ptrs, sel), dtype=dtype),
                       b.column([states[i]["sum"] for i in idx])]
            plan.buckets.append(b)
        return plan
