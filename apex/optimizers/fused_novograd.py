"""``FusedNovoGrad``: Apex's NovoGrad optimizer (per-layer normalised gradients)."""

from __future__ import annotations

import torch

from apex.ops._cpu_blocks import Workspace
from apex.ops._cpu_norms import fp32_norms
from apex.ops.multi_tensor_novograd import multi_tensor_novograd
from apex.optimizers._base import CopyableOptimizer, fused_step, run_closure, trusted, zero_grad
from apex.optimizers._lamb_common import (
    GroupGrads,
    ParamMismatchError,
    check_group_hyperparameters,
    check_hyperparameters,
    group_grads,
    pack_state,
)
from apex.optimizers._plan import Bucket, Plan, step_plans, take

_CHUNK_SIZE = 2048 * 32
# Slots of group["exp_avg_sq"]: Apex's [fp16 norms, fp32 norms], plus bf16 norms when the group has any.
_SLOTS = (torch.float16, torch.float32, torch.bfloat16)


class FusedNovoGrad(CopyableOptimizer):
    """Implements NovoGrad (`Jasper: An End-to-End Convolutional Neural Acoustic Model
    <https://arxiv.org/abs/1904.03288>`_) as Apex's ``FusedNovoGrad``, on CPUs and GPUs.

    The second moment is one number per parameter tensor: the running norm of its gradient, kept in the
    param group as in Apex: ``group["exp_avg_sq"] = [norms of the fp16 params, norms of the fp32 params]``
    (plus a third tensor for bf16 params, which Apex does not support), fp32 tensors in the order of the
    group's parameters that had gradients at the first step. Per tensor, with ``n`` the L2 norm of its
    gradient (``norm_type=2``) or its max-norm (``norm_type=0``)::

        first step: v = 0 if init_zero else n            (then blended like any step)
        v = sqrt(beta2 * v² + (1 - beta2) * n²)           (norm_type=2)
        v = beta2 * v + (1 - beta2) * n                   (norm_type=0)
        d = v / sqrt(1 - beta2**step) + eps               (no correction without bias_correction)
        reg_inside_moment=True:  m = beta1 * m + beta3 * (g / d + weight_decay * p); p -= lr * m / bc1
        reg_inside_moment=False: m = beta1 * m + beta3 * g; p -= lr * ((m / bc1) / d + weight_decay * p)

    with ``beta3 = 1 - beta1`` if ``grad_averaging`` else 1 and ``bc1 = 1 - beta1**step``. Per-parameter
    state: ``exp_avg`` (the parameter's dtype); ``step`` is kept per group.

    Arguments (Apex's): params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0., amsgrad=False (True raises RuntimeError), reg_inside_moment=False, grad_averaging=True,
    norm_type=2 (2 or 0), init_zero=False, set_grad_none=True.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2,
                 init_zero=False, set_grad_none=True):
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                              name="FusedNovoGrad")
        if norm_type not in (0, 2):
            raise ValueError(f"Invalid norm_type: {norm_type!r} (FusedNovoGrad supports 2 (L2 norm) and "
                             "0 (infinity norm))")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, norm_type=norm_type,
                        init_zero=init_zero)
        super().__init__(params, defaults)
        self.multi_tensor_novograd = multi_tensor_novograd
        device = self.param_groups[0]["params"][0].device
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.moment_mode = 0 if reg_inside_moment else 1
        self.set_grad_none = set_grad_none
        self._workspace: dict[tuple[int, int], Workspace] = {}

    def add_param_group(self, param_group: dict) -> None:
        check_group_hyperparameters(self, param_group)
        if param_group.get("norm_type", self.defaults.get("norm_type", 2)) not in (0, 2):
            raise ValueError(f"Invalid norm_type: {param_group['norm_type']!r} (expected 2 or 0)")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, then, as Apex does, the running norms
        (``group["exp_avg_sq"]``) moved to the device of the group's parameters (a checkpoint loaded with
        ``map_location="cpu"`` would leave them on the CPU), as the contiguous fp32 tensors the update
        takes."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if group["params"] and "exp_avg_sq" in group:
                device = group["params"][0].device
                group["exp_avg_sq"] = [
                    n.to(device=device, dtype=torch.float32).contiguous() if isinstance(n, torch.Tensor) else n
                    for n in group["exp_avg_sq"]]

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: to None when ``set_to_none`` (default: the ``set_grad_none`` option)."""
        zero_grad(self, set_to_none)

    @fused_step
    def step(self, closure=None):
        """Performs a single optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = run_closure(closure)
        planned = step_plans(self, (), self._check_group, self._build_plan)
        for group, (plan, gs, gptrs) in zip(self.param_groups, planned):
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            device = plan.buckets[0].device if plan.buckets else self._dummy_overflow_buf.device
            if self._dummy_overflow_buf.device != device:
                self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
            grads = {b.slot: b.grads(gs, gptrs) for b in plan.buckets}
            if "exp_avg_sq" not in group:
                norms = []
                for slot, dt in enumerate(_SLOTS):
                    g = grads.get(slot, ())
                    if dt is torch.bfloat16 and not g:
                        continue
                    if group["init_zero"] or not g:
                        norms.append(torch.zeros(len(g), dtype=torch.float32, device=device))
                    else:  # start from the first step's norms, so the first blend changes nothing
                        ord_ = float("inf") if group["norm_type"] == 0 else 2.0
                        norms.append(fp32_norms(list(g), ord_))
                group["exp_avg_sq"] = norms
            for b in plan.buckets:
                extra = trusted(self.multi_tensor_novograd)
                if b.workspace is not None:
                    extra["workspace"] = b.workspace
                self.multi_tensor_novograd(_CHUNK_SIZE, self._dummy_overflow_buf, [grads[b.slot]] + b.lists,
                                           group["exp_avg_sq"][b.slot], group["lr"], beta1, beta2, group["eps"],
                                           group["step"], 1 if group["bias_correction"] else 0,
                                           group["weight_decay"], 1 if group["grad_averaging"] else 0,
                                           self.moment_mode, group["norm_type"], **extra)
        return loss

    def _check_group(self, gi: int, group: dict) -> GroupGrads:
        """The group's checks, and its stored norms against this step's parameters (before anything
        changes)."""
        gg = group_grads("FusedNovoGrad", gi, group)
        if "exp_avg_sq" in group:
            by_dtype = _by_dtype(gg)
            norms = group["exp_avg_sq"]
            for slot, dt in enumerate(_SLOTS):
                count = len(by_dtype[dt][0]) if dt in by_dtype else 0
                have = norms[slot].numel() if slot < len(norms) and norms[slot] is not None else 0
                if count != have:
                    raise ParamMismatchError(
                        f"FusedNovoGrad: param_groups[{gi}] has {count} {dt} parameters with gradients but "
                        f"{have} running norms; the set of parameters with gradients must not change "
                        "between steps")
        return gg

    def _build_plan(self, group: dict, checked: GroupGrads) -> Plan:
        """State (``exp_avg``) and one launch per dtype slot of ``group["exp_avg_sq"]``."""
        params = checked.params
        plan = Plan(group["params"], params)
        if not params:
            return plan
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        device = params[0].device
        for slot, dt in enumerate(_SLOTS):
            idx = [i for i, d in enumerate(plan.dtypes) if d is dt]
            if not idx:
                continue
            sel = None if len(idx) == len(params) else idx
            ps = take(params, sel)
            states = [self.state[p] for p in ps]
            for p, st in zip(ps, states):
                if not st:
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m = [st["exp_avg"] for st in states]
            b = Bucket(sel, dt, device, tuple(take(plan.numels, sel)))
            b.slot, b.workspace = slot, None
            if self.multi_tensor_novograd is multi_tensor_novograd and device.type == "cpu":
                b.workspace = self._workspace_for((gi, slot), list(take(plan.shapes, sel)))
                if dt is torch.float32:
                    m = pack_state(b.workspace, states, "exp_avg", m, ps)
            b.lists = [b.column(ps, take(plan.ptrs, sel), dtype=dt), b.column(m)]
            plan.buckets.append(b)
        return plan

    def _workspace_for(self, key: tuple[int, int], shapes: list) -> Workspace:
        """The CPU path's reusable buffers for one dtype slot of a group; kept outside the state dict."""
        ws = self._workspace.get(key)
        if ws is None or not ws.has_shapes(shapes):
            ws = self._workspace[key] = Workspace(shapes)
        return ws


def _by_dtype(gg: GroupGrads) -> dict:
    """``{dtype: (params, grads, shapes)}`` for the dtypes of a group's parameters with gradients."""
    if len(gg.dtypes) <= 1:
        return {dt: (gg.params, gg.grads, gg.shapes) for dt in gg.dtypes}
    out = {dt: ([], [], []) for dt in gg.dtypes}
    for p, g, shape in zip(gg.params, gg.grads, gg.shapes):
        ps, gs, ss = out[p.dtype]
        ps.append(p)
        gs.append(g)
        ss.append(shape)
    return out
