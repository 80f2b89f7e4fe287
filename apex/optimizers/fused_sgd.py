"""``FusedSGD``: SGD with momentum, dampening, Nesterov and weight decay, one multi-tensor update per
(device, dtype) group."""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from apex import _backend
from apex.ops import multi_tensor_sgd as _ops
from apex.optimizers._base import FusedOptimizerBase, check_sgd_hyperparameters, fused_step, group_by, trusted
from apex.optimizers._plan import Bucket, Plan, take

_KERNELS: list = []


def _kernels():
    """apex._kernels.multi_tensor_sgd, imported at the first step that launches (it imports triton)."""
    if not _KERNELS:
        from apex._kernels import multi_tensor_sgd

        _KERNELS.append(multi_tensor_sgd)
    return _KERNELS[0]


class FusedSGD(FusedOptimizerBase):
    r"""Stochastic gradient descent with optional momentum, Apex's ``FusedSGD``.

    A drop-in replacement for ``torch.optim.SGD`` with the same rule and state (``momentum_buffer``)::

        g = g + weight_decay * p                         (before momentum unless wd_after_momentum)
        buf = g on the first step, else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf  (nesterov)   or   g = buf
        g = g + weight_decay * p                         (if wd_after_momentum)
        p = p - lr * g

    Arithmetic is fp32; parameters and buffers keep their dtype (fp32, fp16 or bf16). Rounding rule
    (deliberate, issue 22): fp16/bf16 parameters without fp32 masters follow ``torch.optim.SGD`` exactly:
    each line above rounds its result to the storage dtype, so the step uses the *stored* fp16/bf16
    momentum (Apex's CUDA kernel used the unrounded fp32 one and drifted an ulp a step from PyTorch);
    fp32 parameters and amp's fp32 masters are computed in fp32 in one pass, as in Apex. With Apex's amp
    (``amp.initialize(..., opt_level="O2")``) the fp32 master weights of fp16 models are updated and copied
    into the model in the same pass (``materialize_master_grads`` picks which gradients are read), and the
    loss scale recorded by amp (``most_recent_scale``) is divided out inside the update.

    Arguments are Apex's: ``params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False,
    wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False``.
    """

    _name = "FusedSGD"

    def __init__(self, params, lr=required, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False):
        check_sgd_hyperparameters(lr, momentum, dampening, weight_decay, nesterov)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=False, foreach=None, differentiable=False, fused=None)
        super().__init__(params, defaults, set_grad_none=set_grad_none)
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False

        import amp_C

        self.multi_tensor_sgd = amp_C.multi_tensor_sgd

    def get_momentums(self, params):
        """Apex's helper: the momentum buffers of ``params`` (created as zeros) and whether they are new."""
        momentums, first_run = [], True
        for p in params:
            state = self.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p)
                first_run = True
            else:
                first_run = False
            momentums.append(state["momentum_buffer"])
        return momentums, first_run

    @fused_step
    def step(self, closure=None, grad_scaler=None):
        """Perform one update. ``closure`` re-evaluates the model and returns the loss. ``grad_scaler``: the
        ``torch.amp.GradScaler`` whose scale the gradients carry (what ``GradScaler.step`` passes): the step
        is skipped when a gradient is not finite, else the gradients are unscaled first."""
        stash = getattr(self, "_amp_stash", None)
        if stash is not None and hasattr(stash, "fp32_from_fp16_groups"):  # amp O2: masters and model copies
            loss = self._run_closure(closure)
            if self._unscale_or_skip(grad_scaler):
                return loss
            scale = 1.0 / self.most_recent_scale
            for gid, group in enumerate(self.param_groups):
                for launch in self._amp_sets(stash, gid):
                    self._launch(group, launch, scale)
        else:
            loss = self._run_closure(closure)
            planned = self._step_plans()
            if self._unscale_or_skip(grad_scaler, planned):
                return loss
            scale = 1.0 / self.most_recent_scale
            for group, (plan, gs, gptrs) in zip(self.param_groups, planned):
                self._step_plan(group, plan, gs, gptrs, scale)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

    def _amp_sets(self, stash, gid):
        """Apex amp O2: fp32 masters of fp16 params (plus the fp16 copies), and fp32 params."""
        fp32_params = [p for p in stash.fp32_from_fp32_groups[gid] if p.grad is not None]
        sets = [[[p.grad for p in fp32_params], fp32_params]]
        masters, models = stash.fp32_from_fp16_groups[gid], stash.fp16_groups[gid]
        if self.materialize_master_grads:
            pairs = [(m.grad, m, c) for m, c in zip(masters, models) if m.grad is not None]
        else:
            pairs = [(c.grad, m, c) for m, c in zip(masters, models) if c.grad is not None]
        if pairs:
            sets.append([[a for a, _, _ in pairs], [b for _, b, _ in pairs], [c for _, _, c in pairs]])
        return sets

    # -- the usual step: a plan per group (apex.optimizers._plan) ------------------------------------------
    def _build_plan(self, group: dict, checked) -> Plan:
        """Momentum buffers (made here, zero: the first step's kernel sets them to the gradient) and one
        bucket per (dtype, first step of the buffers or not)."""
        params = checked.params
        plan = Plan(group["params"], params)
        plan.momentum = group["momentum"]
        if not params:
            return plan
        device = params[0].device
        if plan.momentum != 0:
            bufs = [self.state[p].get("momentum_buffer") for p in params]
            fresh = [b is None for b in bufs]
            if any(fresh):
                made, _ = self.get_momentums([p for p, f in zip(params, fresh) if f])
                it = iter(made)
                bufs = [next(it) if f else b for b, f in zip(bufs, fresh)]
        else:
            bufs, fresh = None, [False] * len(params)
        for (dtype, first_run), idx in group_by([(p.dtype, f) for p, f in zip(params, fresh)], len(params)).items():
            sel = None if len(idx) == len(params) else idx
            b = Bucket(sel, dtype, device, tuple(take(plan.numels, sel)))
            ps = b.column(take(params, sel), take(plan.ptrs, sel), dtype=dtype)
            b.lists = [ps, ps if bufs is None else b.column(take(bufs, sel), dtype=dtype)]
            b.first_run = first_run
            plan.buckets.append(b)
        return plan

    def _step_plan(self, group: dict, plan: Plan, gs: list, gptrs: tuple, scale: float) -> None:
        if not plan.buckets:
            return
        if (group["momentum"] != 0) != (plan.momentum != 0):  # momentum switched on or off: plan again
            self._plans.pop(id(group), None)
            self._launch(group, [gs, list(plan.with_grad)], scale)
            return
        op = self.multi_tensor_sgd
        for b in plan.buckets:
            tabs = self._launch_tables(b, op, gs, gptrs)
            if tabs is not None:  # apex's op on the Triton backend: its launch, directly
                _kernels().run(tabs, False, self._overflow_buf(b.device), lr=group["lr"], wd=group["weight_decay"],
                               momentum=float(group["momentum"]), dampening=group["dampening"],
                               nesterov=group["nesterov"], first_run=b.first_run,
                               wd_after_momentum=self.wd_after_momentum, scale=scale)
                continue
            op(2048 * 32, self._overflow_buf(b.device), [b.grads(gs, gptrs)] + b.lists, group["weight_decay"],
               group["momentum"], group["dampening"], group["lr"], group["nesterov"], b.first_run,
               self.wd_after_momentum, scale, **trusted(op))
        if any(b.first_run for b in plan.buckets):
            self._plans.pop(id(group), None)  # the buffers exist now: the next step plans one bucket per dtype

    def _launch_tables(self, b: Bucket, op, gs: list, gptrs: tuple) -> list | None:
        """The tables of the bucket's launch when the step may launch it itself, or None (then the op is
        called): as ``FusedAdam._launch_tables``, for apex's own op on the Triton backend (asked every step);
        held while the step's gradient addresses are the tuple they were made with."""
        if op is not _ops.multi_tensor_sgd or _backend.select_device(b.device.type) != "triton":
            return None
        tables = _kernels().tables
        return b.held_tables(gs, gptrs, lambda grads: tables([grads] + b.lists))

    def _launch(self, group, launch, scale: float) -> None:
        """One ``multi_tensor_sgd`` call per (param dtype, grad dtype, first step) bucket (amp O2's lists, and
        a step whose group changed its momentum)."""
        grads, params = launch[0], launch[1]
        copies = launch[2] if len(launch) == 3 else None
        if not params:
            return
        momentum = group["momentum"]
        state = self.state
        existing = [state[p].get("momentum_buffer") for p in params] if momentum != 0 else None
        fresh = [b is None for b in existing] if existing is not None else [False] * len(params)
        device = params[0].device
        buckets = group_by([(p.dtype, g.dtype, f) for p, g, f in zip(params, grads, fresh)], len(params))
        for (_, _, first_run), idx in buckets.items():
            ps = [params[i] for i in idx]
            if momentum == 0:
                bufs = ps  # never read nor written without momentum
            elif first_run:
                bufs, _ = self.get_momentums(ps)
            else:
                bufs = [existing[i] for i in idx]
            lists = [[grads[i] for i in idx], ps, bufs]
            if copies is not None:
                lists.append([copies[i] for i in idx])
            self.multi_tensor_sgd(2048 * 32, self._overflow_buf(device), lists, group["weight_decay"],
                                  momentum, group["dampening"], group["lr"], group["nesterov"], first_run,
                                  self.wd_after_momentum, scale)
