"""``FusedLARS``: ROCm Apex's layer-wise adaptive-rate SGD (LARS), one multi-tensor pass per group."""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from apex import _backend
from apex.optimizers._base import (
    FusedOptimizerBase,
    check_non_negative,
    check_sgd_hyperparameters,
    fused_step,
    group_by,
    trusted,
)
from apex.optimizers._plan import Bucket, Plan, take


class FusedLARS(FusedOptimizerBase):
    r"""LARS (You et al., 2017), ROCm Apex's ``FusedLARS``: SGD where each tensor's learning rate is scaled
    by its trust ratio::

        lr_i = lr * trust_coefficient * ‖p‖ / (‖g‖ + weight_decay * ‖p‖ + eps)     (lr if a norm is 0)
        g = g + weight_decay * p                           (before momentum unless wd_after_momentum)
        buf = momentum * buf - lr_i * (1 - dampening) * g  (buf = -lr_i * g on the first step)
        p = p + buf        (nesterov: p + momentum * buf - lr_i * g;  no momentum: p - lr_i * g)

    A parameter group with ``is_skipped=True`` (e.g. biases and norms) uses the plain ``lr``. The
    momentum buffer (``momentum_buffer``) holds the negative step, as in ROCm's kernel. Norms are taken
    with ``amp_C.multi_tensor_l2norm`` (one pass over the gradients and one over the parameters per
    dtype group), then one fused update. A non-finite gradient skips the step.

    Arguments are ROCm Apex's: ``params, lr, momentum=0, dampening=0, weight_decay=0,
    trust_coefficient=0.001, eps=0.0, nesterov=False, wd_after_momentum=False,
    materialize_master_grads=True, set_grad_none=False``.
    """

    _name = "FusedLARS"

    def __init__(self, params, lr=required, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, trust_coefficient: float = 0.001, eps: float = 0.0,
                 nesterov: bool = False, wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool = False):
        check_sgd_hyperparameters(lr, momentum, dampening, weight_decay, nesterov)
        check_non_negative(trust_coefficient, "trust_coefficient")
        check_non_negative(eps, "eps")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, trust_coefficient=trust_coefficient, eps=eps, is_skipped=False)
        super().__init__(params, defaults, set_grad_none=set_grad_none)
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        self.trust_coefficient = trust_coefficient
        self.eps = eps

        import amp_C

        self.multi_tensor_l2norm = amp_C.multi_tensor_l2norm
        self.multi_tensor_lars = amp_C.multi_tensor_lars

    @fused_step
    def step(self, closure=None, grad_scaler=None):
        """Perform one update. ``closure`` re-evaluates the model and returns the loss. ``grad_scaler``: the
        ``torch.amp.GradScaler`` whose scale the gradients carry (what ``GradScaler.step`` passes): the step
        is skipped when a gradient is not finite, else the gradients are unscaled first."""
        loss = self._run_closure(closure)
        planned = self._step_plans()
        if self._unscale_or_skip(grad_scaler, planned):
            return loss
        scale = 1.0 / self.most_recent_scale
        for group, (plan, gs, gptrs) in zip(self.param_groups, planned):
            if not plan.buckets:
                continue
            if (group["momentum"] != 0) != (plan.momentum != 0):  # momentum switched on or off: plan again
                self._plans.pop(id(group), None)
                plan = self._build_plan(group, plan)
            momentum = group["momentum"]
            for b in plan.buckets:
                flag = self._overflow_buf(b.device)
                flag.zero_()  # a non-finite norm sets it and skips this update only
                ps, g = b.lists[0], b.grads(gs, gptrs)
                if self._on_triton(ps):
                    self._triton_update(group, b, g, flag, scale)
                    continue
                w_norms = self.multi_tensor_l2norm(2048 * 32, flag, [ps], True,
                                                   **trusted(self.multi_tensor_l2norm))[1]
                g_norms = self.multi_tensor_l2norm(2048 * 32, flag, [g], True,
                                                   **trusted(self.multi_tensor_l2norm))[1] * abs(scale)
                self.multi_tensor_lars(2048 * 32, flag, [g] + b.lists, g_norms, w_norms, group["lr"],
                                       group["trust_coefficient"], group["eps"], group["weight_decay"], momentum,
                                       group["dampening"], group["nesterov"], b.first_run, self.wd_after_momentum,
                                       scale, bool(group.get("is_skipped", False)),
                                       **trusted(self.multi_tensor_lars))
            if any(b.first_run for b in plan.buckets):
                self._plans.pop(id(group), None)  # the buffers exist now: the next step plans one bucket per dtype
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

    def _on_triton(self, ps) -> bool:
        """Whether a bucket's update takes the Triton kernels directly (apex's own ops on that backend)."""
        from apex.ops.multi_tensor_l2norm import multi_tensor_l2norm
        from apex.ops.multi_tensor_lars import multi_tensor_lars

        return (self.multi_tensor_l2norm is multi_tensor_l2norm and self.multi_tensor_lars is multi_tensor_lars
                and _backend.select_tensor(ps[0]) == "triton")

    def _triton_update(self, group: dict, b, g, flag: torch.Tensor, scale: float) -> None:
        """One bucket's update on the Triton path: the gradients' and parameters' norms from the update's own
        table ``[g, w, buf, w]`` (two launches for both; new gradients cost one table), then the update."""
        from apex._kernels import multi_tensor as mt
        from apex._kernels import multi_tensor_l2norm as norm_kernels
        from apex._kernels import multi_tensor_sgd as kernels

        ps = b.lists[0]
        lists = [g] + b.lists
        tab = mt.table(lists + [ps])  # (the update's table: the kernel's call below finds it cached)
        norms = norm_kernels.pair_norms(flag, tab, self.__dict__.setdefault("_scratch", {}))
        n = len(ps)
        g_norms, w_norms = norms[:n], norms[n:2 * n]
        if abs(scale) != 1.0:
            g_norms = g_norms * abs(scale)
        if group.get("is_skipped", False):
            g_norms = torch.zeros_like(g_norms)  # exactly lr for every tensor (see multi_tensor_lars)
        kernels.sgd(flag, lists, lr=float(group["lr"]), wd=float(group["weight_decay"]),
                    momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                    nesterov=bool(group["nesterov"]), first_run=bool(b.first_run),
                    wd_after_momentum=bool(self.wd_after_momentum), scale=float(scale), grad_norms=g_norms,
                    param_norms=w_norms, trust_coefficient=float(group["trust_coefficient"]),
                    eps=float(group["eps"]), lars=True)

    def _build_plan(self, group: dict, checked) -> Plan:
        """Momentum buffers (made here, zero: the first step's kernel sets them) and one bucket per
        (dtype, first step of the buffers or not)."""
        params = list(checked.params if not isinstance(checked, Plan) else checked.with_grad)
        plan = Plan(group["params"], params)
        plan.momentum = group["momentum"]
        if not params:
            return plan
        device = params[0].device
        if plan.momentum != 0:
            fresh = [self.state[p].get("momentum_buffer") is None for p in params]
            for p, f in zip(params, fresh):
                if f:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
        else:
            fresh, bufs = [False] * len(params), None
        for (dtype, first_run), idx in group_by([(p.dtype, f) for p, f in zip(params, fresh)], len(params)).items():
            sel = None if len(idx) == len(params) else idx
            b = Bucket(sel, dtype, device, tuple(take(plan.numels, sel)))
            ps = b.column(take(params, sel), take(plan.ptrs, sel), dtype=dtype)
            b.lists = [ps, ps if bufs is None else b.column(take(bufs, sel), dtype=dtype)]  # ps: never read
            b.first_run = first_run
            plan.buckets.append(b)
        return plan


Fused_LARS = FusedLARS  # ROCm Apex's class name
