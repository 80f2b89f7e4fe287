"""``FusedLAMB``: Apex's LAMB optimizer (layer-wise adaptive moments for large-batch training)."""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._cpu_blocks import Workspace
from apex.ops.multi_tensor_l2norm import multi_tensor_l2norm
from apex.ops.multi_tensor_lamb import multi_tensor_lamb
from apex.optimizers._base import CopyableOptimizer, fused_step, run_closure, trusted, zero_grad
from apex.optimizers._lamb_common import (
    all_grads,
    check_group_hyperparameters,
    check_hyperparameters,
    group_grads,
    lamb_bucket,
)
from apex.optimizers._plan import Plan, step_plans

_CHUNK_SIZE = 2048 * 32


class FusedLAMB(CopyableOptimizer):
    """Implements the LAMB algorithm (`Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes <https://arxiv.org/abs/1904.00962>`_), as Apex's ``FusedLAMB``, on CPUs and GPUs.

    One step, with ``‖g‖`` the L2 norm of **all** gradients of **all** groups (clipped to
    ``max_grad_norm``, taken from the constructor's defaults as in Apex) and, per parameter tensor::

        ĝ = g / max(1, ‖g‖ / max_grad_norm)      (+ weight_decay * p when adam_w_mode=False)
        m = beta1 * m + beta3 * ĝ                 beta3 = 1 - beta1 if grad_averaging else 1
        v = beta2 * v + (1 - beta2) * ĝ²
        u = (m / bc1) / (sqrt(v / bc2) + eps)    (+ weight_decay * p when adam_w_mode=True)
        p = p - lr * (‖p‖ / ‖u‖) * u              trust ratio only if weight_decay != 0 or use_nvlamb,
                                                  and both norms are non-zero; else p = p - lr * u

    ``bc1 = 1 - beta1**step``, ``bc2 = 1 - beta2**step`` with ``bias_correction`` (else 1); ``step`` is kept
    per group (``param_groups[i]["step"]``). State per parameter: ``exp_avg`` and ``exp_avg_sq``, of the
    parameter's dtype (fp32, fp16 or bf16; math in fp32). The Triton path leaves the gradients as they
    are; the CPU path may divide them in place by the clip factor (Apex's kernel overwrites them with the
    update) and keeps one fp32 work buffer per fp32 parameter, outside the state dict.

    Arguments:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate (default 1e-3).
        bias_correction: apply Adam's bias correction (default True).
        betas: coefficients of the running averages of the gradient and its square (default (0.9, 0.999)).
        eps: added to the denominator for numerical stability (default 1e-6).
        weight_decay: weight decay (default 0.01).
        amsgrad: not supported; True raises RuntimeError.
        adam_w_mode: decoupled weight decay (True, default) or L2 regularisation (False).
        grad_averaging: multiply the gradient by (1 - beta1) in the first moment (default True).
        set_grad_none: ``zero_grad()`` sets gradients to None (default True).
        max_grad_norm: clip the global gradient norm to this value (default 1.0).
        use_nvlamb: apply the trust ratio also to parameters with zero weight decay (default False).

    Paths: a Triton multi-tensor kernel on GPUs (the global norm, then per (device, dtype) group one
    launch without the trust ratio, or three with it: moments + per-chunk norms, per-tensor reduction,
    apply); ``torch._foreach_*`` ops on CPUs.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False):
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              max_grad_norm=max_grad_norm, amsgrad=amsgrad, name="FusedLAMB")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.multi_tensor_l2norm = multi_tensor_l2norm
        self.multi_tensor_lamb = multi_tensor_lamb
        device = self.param_groups[0]["params"][0].device
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb
        self._workspace: dict[int, Workspace] = {}

    def add_param_group(self, param_group: dict) -> None:
        check_group_hyperparameters(self, param_group)
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: to None when ``set_to_none`` (default: the ``set_grad_none`` option)."""
        zero_grad(self, set_to_none)

    @fused_step
    def step(self, closure=None):
        """Performs a single optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = run_closure(closure)
        planned = step_plans(self, (), lambda gi, group: group_grads("FusedLAMB", gi, group), self._build_plan)
        if self._on_triton(planned):
            self._triton_step(planned)
            return loss
        grads = all_grads(planned)
        if grads is not None:
            device = grads.device if grads.device is not None else grads[0].device
            if self._dummy_overflow_buf.device != device:
                self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
            global_grad_norm = self.multi_tensor_l2norm(_CHUNK_SIZE, self._dummy_overflow_buf, [grads],
                                                        False, **trusted(self.multi_tensor_l2norm))[0]
        max_grad_norm = self.defaults["max_grad_norm"]
        for gi, (group, (plan, gs, gptrs)) in enumerate(zip(self.param_groups, planned)):
            group["step"] = group.get("step", 0) + 1
            if not plan.buckets:
                continue
            beta1, beta2 = group["betas"]
            b = plan.buckets[0]
            g = b.grads(gs, gptrs)
            args = (_CHUNK_SIZE, self._dummy_overflow_buf, [g] + b.lists, group["lr"], beta1, beta2,
                    group["eps"], group["step"], 1 if group["bias_correction"] else 0, group["weight_decay"],
                    1 if group["grad_averaging"] else 0, self.adam_w_mode, global_grad_norm, max_grad_norm,
                    self.use_nvlamb)
            if self.multi_tensor_lamb is multi_tensor_lamb:
                self.multi_tensor_lamb(*args, workspace=self._workspace_for(gi, b.lists[0], list(plan.shapes)),
                                       validate=False)
            else:  # a subclass's own op, called the Apex way
                self.multi_tensor_lamb(*args[:2], [list(x) for x in args[2]], *args[3:])
        return loss

    def _on_triton(self, planned: list) -> bool:
        """Whether this step takes the Triton kernels directly: apex's own ops, the Triton backend for the
        parameters, and every group on one device (the global norm's)."""
        if self.multi_tensor_lamb is not multi_tensor_lamb or self.multi_tensor_l2norm is not multi_tensor_l2norm:
            return False
        devices = {b.device for plan, _, _ in planned for b in plan.buckets}
        if len(devices) != 1:
            return False
        first = next(b for plan, _, _ in planned for b in plan.buckets)
        return _backend.select_tensor(first.lists[0][0]) == "triton"

    def _triton_step(self, planned: list) -> None:
        """The step on the Triton path, without the ops' wrappers: one device table per (group, dtype) with
        this step's gradients, which the global norm's partials, the moments and the apply launches all read;
        partial sums and norms in buffers kept from step to step."""
        from apex._kernels import multi_tensor_l2norm as norm_kernels
        from apex._kernels import multi_tensor_lamb as kernels

        work = []
        for group, (plan, gs, gptrs) in zip(self.param_groups, planned):
            for b in plan.buckets:
                # (the tables depend on nothing else the plan does not fix)
                work.append((group, b.held_tables(gs, gptrs, lambda grads, b=b: kernels.tables(grads, *b.lists, None))))
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        every = [t for _, tabs in work for t in tabs]
        if not every:  # only empty tensors
            return
        device = every[0].ptrs.device
        flag = self._dummy_overflow_buf
        if flag.device != device:
            flag = self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        scratch = self.__dict__.setdefault("_scratch", {})
        grad_norm = norm_kernels.total_of_tables(flag, every, scratch=scratch)
        max_grad_norm = float(self.defaults["max_grad_norm"])
        for group, tabs in work:
            beta1, beta2 = group["betas"]
            kernels.lamb_on(flag, tabs, has_out=False, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                            eps=group["eps"], step=group["step"], bias_correction=bool(group["bias_correction"]),
                            weight_decay=float(group["weight_decay"]),
                            beta3=1.0 - float(beta1) if group["grad_averaging"] else 1.0,
                            adam_w=bool(self.adam_w_mode), grad_norm=grad_norm, max_grad_norm=max_grad_norm,
                            use_nvlamb=bool(self.use_nvlamb), scratch=scratch)

    def _build_plan(self, group: dict, checked) -> Plan:
        """State (``exp_avg``, ``exp_avg_sq``) and one launch for the group's parameters with a gradient."""
        params = checked.params
        plan = Plan(group["params"], params)
        if not params:
            return plan
        m, v = [], []
        for param in params:
            state = self.state[param]
            if not state:
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            m.append(state["exp_avg"])
            v.append(state["exp_avg_sq"])
        plan.buckets.append(lamb_bucket(plan, params, m, v))
        return plan

    def _workspace_for(self, gi: int, params: list, shapes: list) -> Workspace | None:
        """The CPU path's reusable buffers for group ``gi`` (building them every step costs more than the
        step's arithmetic); kept outside the state dict. ``shapes``: the parameters' shapes, at hand from
        the step's checks."""
        if not params[0].is_cpu:
            return None
        ws = self._workspace.get(gi)
        if ws is None or not ws.has_shapes(shapes):
            ws = self._workspace[gi] = Workspace(shapes)
        return ws
