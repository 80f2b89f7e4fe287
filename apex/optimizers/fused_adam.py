"""``FusedAdam``: Adam and AdamW with one multi-tensor update per (device, dtype) group."""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops import multi_tensor_adam as _ops
from apex.optimizers._base import (
    FusedOptimizerBase,
    _number,
    check_betas,
    check_non_negative,
    fused_step,
    group_by,
    trusted,
)
from apex.optimizers._plan import Bucket, Plan, take

# apex's own ops, which the step may bypass for their kernels' launches (an op swapped in is always called)
_OWN_OPS = (_ops.multi_tensor_adam, _ops.multi_tensor_adam_capturable, _ops.multi_tensor_adam_capturable_master)
_KERNELS: list = []


def _kernels():
    """apex._kernels.multi_tensor_adam, imported at the first step that launches (it imports triton)."""
    if not _KERNELS:
        from apex._kernels import multi_tensor_adam

        _KERNELS.append(multi_tensor_adam)
    return _KERNELS[0]


class FusedAdam(FusedOptimizerBase):
    r"""Adam (``adam_w_mode=False``) and AdamW (``adam_w_mode=True``, the default), Apex's ``FusedAdam``.

    A drop-in replacement for ``torch.optim.AdamW`` (or ``torch.optim.Adam`` with ``adam_w_mode=False``).
    For each parameter with gradient ``g`` at step ``t``::

        L2 mode:  g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g²
        u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)   (bias_correction=False: no 1 - beta^t)
        AdamW:    u = u + weight_decay * p
        p = p - lr * u

    Arithmetic is fp32; ``exp_avg``/``exp_avg_sq`` are fp32 for fp32, fp16 and bf16 parameters. With
    ``master_weights=True`` fp16 and bf16 parameters are updated through an fp32 master copy and receive
    its rounded value. As in Apex, ``param_groups_master`` mirrors ``param_groups`` with each parameter's
    master (``None`` without master weights; an fp32 parameter is its own master); a master made at
    construction is refreshed from its parameter at the first step if the parameter changed in between
    (weights loaded into the model) and the master was not written. From the first step on it is also
    the state's ``master_param``, so that checkpoints carry it.

    ``state_dict()`` uses PyTorch's keys (``exp_avg``, ``exp_avg_sq``, per-parameter ``step``) so
    checkpoints move to and from ``torch.optim.AdamW``/``Adam``, and, as Apex, each group's step count
    ``param_groups[i]["step"]`` (an int, or a one-element int32 device tensor when capturable, which a
    skipped step leaves unchanged); a checkpoint that has only the group's step (Apex's, or
    Megatron-LM's distributed optimizer's) resumes from it.

    ``capturable=True`` keeps ``lr`` and ``step`` as device tensors and never synchronises with the host;
    ``step(grad_scaler=scaler)`` (or ``torch.amp.GradScaler.step``) unscales the gradients inside the
    update and skips it, leaving parameters and state untouched, when an inf or NaN was found.

    Arguments are Apex's: ``params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    adam_w_mode=True, weight_decay=0., amsgrad=False, set_grad_none=True, capturable=False,
    master_weights=False``. ``amsgrad=True`` raises ``RuntimeError`` (not supported, as in Apex).
    """

    _fp32_state_keys = ("exp_avg", "exp_avg_sq", "master_param")
    _name = "FusedAdam"

    def __init__(self, params, lr=1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False, master_weights: bool = False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        check_non_negative(lr, "lr")
        check_non_negative(eps, "eps")
        check_betas(betas)
        check_non_negative(weight_decay, "weight_decay")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, amsgrad=False, maximize=False, foreach=None,
                        capturable=bool(capturable), differentiable=False, fused=None,
                        decoupled_weight_decay=bool(adam_w_mode))
        super().__init__(params, defaults, set_grad_none=set_grad_none, master_weights=master_weights)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = bool(capturable)
        self._init_masters()
        if self.capturable:
            self._step_supports_amp_scaling = True
            for group in self.param_groups:
                self._lr_to_device(group)

        import amp_C

        self.multi_tensor_adam = amp_C.multi_tensor_adam
        self.multi_tensor_adam_capturable = amp_C.multi_tensor_adam_capturable
        self.multi_tensor_adam_capturable_master = amp_C.multi_tensor_adam_capturable_master

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "capturable", False):
            self._lr_to_device(self.param_groups[-1])
        if hasattr(self, "param_groups_master"):  # (not yet during the constructor)
            self.param_groups_master.append(self._group_masters(self.param_groups[-1]))

    @staticmethod
    def _lr_to_device(group: dict) -> None:
        if not group["params"]:
            return
        device = group["params"][0].device
        lr = group["lr"]
        group["lr"] = (lr.to(device=device, dtype=torch.float32) if isinstance(lr, torch.Tensor)
                       else torch.tensor(float(lr), dtype=torch.float32, device=device))

    def _after_load(self) -> None:
        for group in self.param_groups:
            loaded = group.get("step")
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                if "step" not in st and "exp_avg" in st and loaded is not None:
                    st["step"] = _number(loaded, "step")  # a checkpoint that keeps only the group's step
                if "step" in st:
                    s = st["step"]
                    if not isinstance(s, torch.Tensor):
                        s = torch.tensor(float(s), dtype=torch.float32)
                    st["step"] = s.to(device=p.device if self.capturable else "cpu", dtype=torch.float32)
            if loaded is None:  # a torch.optim checkpoint: the group's count is its parameters' count
                counts = [float(self.state[p]["step"]) for p in group["params"] if "step" in self.state.get(p, {})]
                if counts:
                    group["step"] = int(max(counts))
            if "step" in group:
                group["step"] = self._group_step_value(group, _number(group["step"], "step"))
            if self.capturable:
                self._lr_to_device(group)
        self._sync_masters()

    def _group_step_value(self, group: dict, count: float):
        """A group's step count in Apex's form: an int, or a one-element int32 tensor on the group's
        device when capturable."""
        if not self.capturable:
            return int(count)
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        return torch.tensor([int(count)], dtype=torch.int32, device=device)

    def _bump_group_step(self, group: dict, found: torch.Tensor | None = None, ok: torch.Tensor | None = None
                         ) -> None:
        """Apex's group step count: +1 per step (when capturable, +0 on a step skipped for an inf: ``found``
        non-zero, or ``ok``, a one-element bool tensor, false)."""
        count = group.get("step")
        if not self.capturable:
            group["step"] = (count if type(count) is int else 0 if count is None else int(_number(count, "step"))) + 1
            return
        if not isinstance(count, torch.Tensor) or count.device != group["params"][0].device \
                or count.dtype != torch.int32:
            count = group["step"] = self._group_step_value(group, 0 if count is None else _number(count, "step"))
        if ok is None:
            ok = True if found is None else (found == 0).reshape(count.shape)
        count.add_(ok)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        had_moments = "exp_avg" in state
        if not had_moments:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                   memory_format=torch.preserve_format)
        if "step" not in state:
            # Moments set without a step (by a subclass that keeps Apex's group step): resume from it; a
            # parameter seen for the first time starts at 0 whatever the group's count.
            start = _number(group["step"], "step") if had_moments and group.get("step") is not None else 0.0
            state["step"] = torch.tensor(start, dtype=torch.float32,
                                         device=p.device if self.capturable else "cpu")
        return state

    @fused_step
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None,
             grad_scaler=None):
        """Perform one update. ``closure`` re-evaluates the model and returns the loss.

        ``grads``, ``output_params``, ``scale`` and ``grad_norms`` are Apex's deprecated arguments and raise.
        """
        if grads is not None or output_params is not None or scale is not None or grad_norms is not None:
            raise RuntimeError("FusedAdam has been updated.  Simply initialize it identically to "
                               "torch.optim.Adam, and call step() with no arguments.")
        loss = self._run_closure(closure)
        planned = self._step_plans()
        if not self.capturable and self._unscale_or_skip(grad_scaler, planned):
            return loss
        scaling: dict = {}  # capturable: (found_inf, inv_scale) per device, read once per step

        def scaling_on(device):
            if device not in scaling:
                grads = None if grad_scaler is None else [b.grads(gs, gptrs) for plan, gs, gptrs in planned
                                                          for b in plan.buckets]
                info = self._scaler_tensors(grad_scaler, device, grads)
                scaling[device] = info if info is not None else self._no_scaling(device)
            return scaling[device]

        for group, (plan, gs, gptrs) in zip(self.param_groups, planned):
            if plan.with_grad:
                self._step_plan(group, plan, gs, gptrs, scaling_on)
            elif group["params"]:  # Apex counts the group's steps even when none of its parameters has a grad
                self._bump_group_step(group, scaling_on(group["params"][0].device)[0]
                                      if self.capturable else None)
        if getattr(self, "_masters_stale", False):
            self._sync_masters()
        return loss

    def _plan_mode(self) -> tuple:
        return (self.capturable, self.master_weights)

    def _build_plan(self, group: dict, checked) -> Plan:
        """State, masters, packed step counters and one bucket per launch: (dtype, master or not) and, when
        not capturable, the step count (parameters that joined later count their own steps)."""
        params = checked.params
        plan = Plan(group["params"], params)
        if not params:
            return plan
        states = [self._init_state(p, group) for p in params]
        masters = [self._master(p) for p in params]
        device = params[0].device
        plan.step_buf, values = self._pack_steps(states, device if self.capturable else torch.device("cpu"))
        plan.watch(plan.step_buf)
        if not self.capturable:  # counted through a NumPy view: no PyTorch op per step (nor a version bump)
            plan.step_host = plan.step_buf.numpy()
        if self.capturable:
            keys = [(p.dtype, m is not None) for p, m in zip(params, masters)]
        else:
            keys = [(p.dtype, m is not None, v) for p, m, v in zip(params, masters, values)]
        for key, idx in group_by(keys, len(params)).items():
            sel = None if len(idx) == len(params) else idx
            b = Bucket(sel, key[0], device, tuple(take(plan.numels, sel)))
            b.lists = [b.column(take(params, sel), take(plan.ptrs, sel)),
                       b.column([states[i]["exp_avg"] for i in idx]),
                       b.column([states[i]["exp_avg_sq"] for i in idx])]
            if key[1]:
                b.lists.append(b.column([masters[i] for i in idx], dtype=torch.float32))
            b.master = key[1]
            b.step = plan.step_buf[idx[0]] if self.capturable else key[2]
            plan.buckets.append(b)
        return plan

    def _flag_from(self, found: torch.Tensor, noop: torch.Tensor) -> torch.Tensor:
        """Set the kernels' skip flag ``noop`` from ``found`` (inf/NaN found) and return ``found == 0`` (a
        one-element bool tensor, by which the step counters move). Without a scaler ``found`` is the constant
        zero of ``_no_scaling``: the flag is cleared once, and no op runs at the following steps."""
        device = noop.device
        consts = self._overflow_bufs.get(("no scaling", device))
        if consts is not None and found is consts[0]:
            ok = self._overflow_bufs.get(("ok", device))
            if ok is None or self._overflow_bufs.get(("flag clear", device)) is not noop:
                noop.zero_()
                ok = self._overflow_bufs[("ok", device)] = torch.ones(1, dtype=torch.bool, device=device)
                self._overflow_bufs[("flag clear", device)] = noop
            return ok
        self._overflow_bufs[("flag clear", device)] = None
        torch.ne(found, 0, out=noop)
        return torch.logical_not(noop)

    def _step_plan(self, group: dict, plan: Plan, gs: list, gptrs: tuple, scaling_on) -> None:
        beta1, beta2 = group["betas"]
        bias_correction = 1 if group.get("bias_correction", True) else 0
        device = plan.buckets[0].device
        if self.capturable:
            found, inv_scale = scaling_on(device)
            noop = self._overflow_buf(device)
            ok = self._flag_from(found, noop)
            plan.step_buf.add_(ok)
            self._bump_group_step(group, ok=ok)
            plan.watch(plan.step_buf)
        else:
            plan.step_host += 1.0
            self._bump_group_step(group)
        for b in plan.buckets:
            if self.capturable:
                op = self.multi_tensor_adam_capturable_master if b.master else self.multi_tensor_adam_capturable
                tabs = self._launch_tables(b, op, gs, gptrs)
                if tabs is not None:
                    lr, step, inv = (_ops._scalar(group["lr"], device, "lr"), _ops._scalar(b.step, device, "step"),
                                     _ops._scalar(inv_scale, device, "inv_scale"))
                    _kernels().run(tabs, b.master, noop, lr, step, inv, 0.0, 1.0, 1.0, beta1, beta2,
                                      group["eps"], group["weight_decay"], self.adam_w_mode, bias_correction,
                                      capturable=True)
                    continue
                op(2048 * 32, noop, [b.grads(gs, gptrs)] + b.lists, group["lr"], beta1, beta2, group["eps"],
                   b.step, self.adam_w_mode, bias_correction, group["weight_decay"], inv_scale, **trusted(op))
            else:
                b.step += 1
                op = self.multi_tensor_adam
                tabs = self._launch_tables(b, op, gs, gptrs)
                if tabs is not None:
                    beta1, beta2 = float(beta1), float(beta2)
                    bc1, bc2 = _ops._bias_corrections(beta1, beta2, int(b.step), bias_correction)
                    _kernels().run(tabs, b.master, self._overflow_buf(device), None, None, None,
                                      float(group["lr"]), bc1, bc2, beta1, beta2, group["eps"],
                                      group["weight_decay"], self.adam_w_mode, bias_correction, capturable=False)
                    continue
                op(2048 * 32, self._overflow_buf(device), [b.grads(gs, gptrs)] + b.lists, group["lr"], beta1,
                   beta2, group["eps"], int(b.step), self.adam_w_mode, bias_correction, group["weight_decay"],
                   **trusted(op))

    def _launch_tables(self, b: Bucket, op, gs: list, gptrs: tuple) -> list | None:
        """The tables of the bucket's Adam launches when the step may launch them itself, or None (then the op
        is called). It may when ``op`` is apex's own and the Triton backend is selected (asked at every step):
        the op would check nothing the plan has not (its lists are the plan's, of one device and dtype each)
        and launch these tables with this step's hyper-parameters. The tables are held while the step's
        gradient addresses are the tuple they were made with (the plan hands that same tuple on while the
        addresses repeat); otherwise the engine's cache gives them."""
        if op not in _OWN_OPS or _backend.select_device(b.device.type) != "triton":
            return None
        tables = _kernels().tables
        return b.held_tables(gs, gptrs, lambda grads: tables([grads] + b.lists))
