"""``FusedMixedPrecisionLamb``: LAMB with fp32 master weights, device-side lr/step and GradScaler support."""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._checks import in_param_shapes, mark_found_inf
from apex.ops._cpu_blocks import Workspace
from apex.ops._cpu_norms import fp32_norms
from apex.ops._lamb_cpu import grads_to_workspace
from apex.ops.multi_tensor_l2norm import multi_tensor_l2norm_mp
from apex.ops.multi_tensor_lamb import multi_tensor_lamb_mp
from apex.optimizers._base import CopyableOptimizer, fused_step, run_closure, scaler_state, trusted, zero_grad
from apex.optimizers._lamb_common import (
    all_grads,
    check_group_hyperparameters,
    check_hyperparameters,
    group_grads,
)
from apex.optimizers._plan import Bucket, Plan, step_plans, take

_CHUNK_SIZE = 2048 * 32


class FusedMixedPrecisionLamb(CopyableOptimizer):
    """Apex's ``FusedMixedPrecisionLamb``: the LAMB update of :class:`FusedLAMB` for models whose
    parameters are in a reduced precision.

    * Parameters of dtype ``reduced_precision_dtype`` (fp16 or bf16) get an fp32 master copy, made at the
      first step (so that a DDP broadcast after construction is picked up); the update runs on the
      master and is rounded once into the model parameter. The masters are also kept in the state as
      ``master_param`` so that a checkpoint resumes exactly. ``exp_avg``/``exp_avg_sq`` are fp32 for these
      parameters and of the parameter's dtype otherwise.
    * ``lr`` and ``step`` are one-element tensors on the parameters' device (``param_groups[i]["lr"]``,
      ``["step"]``), so a step needs no host synchronisation on GPUs.
    * ``step(grad_scaler=scaler)`` (what ``torch.amp.GradScaler.step`` calls, since the optimizer sets
      ``_step_supports_amp_scaling``) unscales the gradients inside the update and, when the scaler found
      an inf/NaN, skips the whole update: parameters, moments and ``step`` are left untouched. A non-finite
      gradient norm skips the step too.
    * The global gradient norm is clipped to ``max_grad_norm`` (the constructor's value, for every group).

    Arguments (Apex's): params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
    weight_decay=0.01, amsgrad=False (True raises RuntimeError), adam_w_mode=True, grad_averaging=True,
    max_grad_norm=1.0, use_nvlamb=False, reduced_precision_dtype=None.
    """

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False, reduced_precision_dtype=None):
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              max_grad_norm=max_grad_norm, amsgrad=amsgrad, name="FusedLAMB")
        if reduced_precision_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError("reduced_precision_dtype must be None, torch.float16 or torch.bfloat16, got "
                             f"{reduced_precision_dtype!r}")
        defaults = dict(lr=torch.tensor(float(lr), dtype=torch.float32),
                        step=torch.tensor([int(step)], dtype=torch.int),
                        bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        device = self.param_groups[0]["params"][0].device
        for group in self.param_groups:
            self._tensorize(group, device)
        self.multi_tensor_l2norm = multi_tensor_l2norm_mp
        self.multi_tensor_lamb = multi_tensor_lamb_mp
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.reduced_precision_dtype = reduced_precision_dtype
        self.param_groups_full_precision = []
        self._step_supports_amp_scaling = True
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb
        self._workspace: dict = {}

    @staticmethod
    def _tensorize(group: dict, device) -> None:
        lr = group["lr"]
        group["lr"] = (lr.detach().to(device=device, dtype=torch.float32) if isinstance(lr, torch.Tensor)
                       else torch.tensor(float(lr), dtype=torch.float32, device=device))
        step = group["step"]
        group["step"] = (step.detach().reshape(1).to(device=device, dtype=torch.int)
                         if isinstance(step, torch.Tensor)
                         else torch.tensor([int(step)], dtype=torch.int, device=device))

    def add_param_group(self, param_group: dict) -> None:
        # Tensor defaults are cloned so that groups never share (and jointly mutate) one lr/step tensor.
        check_group_hyperparameters(self, param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for name, default in self.defaults.items():
            if isinstance(default, torch.Tensor) and group[name] is default:
                group[name] = default.clone()
        if hasattr(self, "param_groups_full_precision"):
            self._tensorize(group, group["params"][0].device)
            if self.param_groups_full_precision:
                self.param_groups_full_precision.append({"params": self._masters(group)})

    def zero_grad(self, set_to_none: bool | None = True) -> None:
        zero_grad(self, True if set_to_none is None else set_to_none)

    @property
    def set_grad_none(self) -> bool:
        return True

    def _is_reduced(self, p: torch.Tensor) -> bool:
        return self.reduced_precision_dtype is not None and p.dtype == self.reduced_precision_dtype

    def _masters(self, group: dict) -> list:
        out = []
        for p in group["params"]:
            if not self._is_reduced(p):
                out.append(None)
                continue
            state = self.state[p]
            if "master_param" not in state:
                state["master_param"] = p.detach().clone().to(torch.float32)
            out.append(state["master_param"])
        return out

    def _setup_full_precision_params(self) -> None:
        self.param_groups_full_precision = [{"params": self._masters(g)} for g in self.param_groups]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict, keeping the saved dtypes (fp32 moments and masters of reduced-precision
        parameters are not cast to the parameters' dtype, unlike ``torch.optim.Optimizer``)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for key, p in zip(ids, params):
            if key in saved:
                for name, value in saved[key].items():
                    if isinstance(value, torch.Tensor):
                        self.state[p][name] = value.detach().clone().to(device=p.device)
        for group in self.param_groups:
            self._tensorize(group, group["params"][0].device)
        self.param_groups_full_precision = []

    @fused_step
    def step(self, closure=None, grad_scaler=None):
        """One step. ``grad_scaler`` (Apex's argument, which ``torch.amp.GradScaler.step`` passes): the
        scaler whose scale the gradients carry; after ``grad_scaler.unscale_(optimizer)`` they carry none
        and the inf check already made is used. Without it, the ``grad_scale``/``found_inf`` attributes
        that a scaler may set on the optimizer are honoured."""
        loss = run_closure(closure)
        planned = step_plans(self, (self.reduced_precision_dtype,), self._check_group, self._build_plan)
        device = self.param_groups[0]["params"][0].device
        if (grad_scaler is None and getattr(self, "grad_scale", None) is None
                and getattr(self, "found_inf", None) is None and self._on_triton(planned, device)):
            self._triton_step(planned, device)
            return loss
        if grad_scaler is not None:
            found_inf, scale = scaler_state(self, grad_scaler, device,
                                            [b.grads(gs, gptrs) for plan, gs, gptrs in planned for b in plan.buckets])
            inv_scale = scale.double().reciprocal().float()
        elif getattr(self, "grad_scale", None) is not None:
            found_inf = getattr(self, "found_inf", None)
            found_inf = torch.zeros(1, device=device) if found_inf is None else found_inf.to(device)
            scale = self.grad_scale.reshape(1).float().to(device)
            inv_scale = scale.double().reciprocal().float()
        else:
            found_inf = getattr(self, "found_inf", None)  # a scaler that already unscaled sets only this
            found_inf = torch.zeros(1, device=device) if found_inf is None else found_inf.to(device)
            scale = torch.ones(1, device=device)
            inv_scale = torch.ones(1, device=device)
        if self._on_triton(planned, device):
            self._triton_step(planned, device, (found_inf, scale, inv_scale))
            return loss
        self._dummy_overflow_buf.copy_(found_inf.reshape(1))
        # The per-group lists: [grads, masters, m, v, model params] for parameters with fp32 masters,
        # [grads, params, m, v] for the others (a new outer list each step: the CPU path may swap the grads).
        lists = {(gi, b.kind): [b.grads(gs, gptrs)] + b.lists
                 for gi, (plan, gs, gptrs) in enumerate(planned) for b in plan.buckets}
        if not lists:
            return loss
        grads = all_grads(planned)
        # The norm is of the scaled gradients, so the threshold is scaled too.
        max_grad_norm = self.defaults["max_grad_norm"] * scale
        # The PyTorch path's workspaces, one per list, looked up once per step (only where that path runs:
        # the lookup compares every parameter's shape).
        cpu = (self.multi_tensor_lamb is multi_tensor_lamb_mp and device.type == "cpu"
               and _backend.select(grads) == "torch")
        workspaces = {key: self._workspace_for(key, lst[1]) for key, lst in lists.items()} if cpu else {}
        if (cpu and self.multi_tensor_l2norm is multi_tensor_l2norm_mp
                and grads.dtype is not torch.float32):
            grad_norm = self._cpu_grad_norm(lists, workspaces)
        else:
            grad_norm = self.multi_tensor_l2norm(_CHUNK_SIZE, self._dummy_overflow_buf, [grads], False,
                                                 **trusted(self.multi_tensor_l2norm))[0]
        for gi, group in enumerate(self.param_groups):
            if isinstance(group["lr"], (int, float)) or isinstance(group["step"], int):
                self._tensorize(group, device)  # an LR scheduler or a user wrote a Python number
            group["step"] += (self._dummy_overflow_buf != 1).to(torch.int)
            beta1, beta2 = group["betas"]
            for kind in (0, 1):
                if (gi, kind) not in lists:
                    continue
                args = (_CHUNK_SIZE, self._dummy_overflow_buf, lists[gi, kind], group["lr"], beta1, beta2,
                        group["eps"], group["step"], 1 if group["bias_correction"] else 0, group["weight_decay"],
                        1 if group["grad_averaging"] else 0, self.adam_w_mode, grad_norm, max_grad_norm,
                        self.use_nvlamb, found_inf, inv_scale)
                if cpu:
                    self.multi_tensor_lamb(*args, workspace=workspaces[gi, kind], validate=False)
                elif self.multi_tensor_lamb is multi_tensor_lamb_mp:
                    self.multi_tensor_lamb(*args, validate=False)
                else:  # a subclass's own op, called the Apex way
                    self.multi_tensor_lamb(*args[:2], [list(x) for x in args[2]], *args[3:])
        return loss

    def _on_triton(self, planned: list, device: torch.device) -> bool:
        """Whether this step takes the Triton kernels directly: apex's own ops, the Triton backend for the
        parameters, every list on ``device``."""
        if self.multi_tensor_lamb is not multi_tensor_lamb_mp or self.multi_tensor_l2norm is not multi_tensor_l2norm_mp:
            return False
        buckets = [b for plan, _, _ in planned for b in plan.buckets]
        if not buckets or any(b.device != device for b in buckets):
            return False
        return _backend.select_tensor(buckets[0].lists[0][0]) == "triton"

    def _triton_step(self, planned: list, device: torch.device, scaling: tuple | None = None) -> None:
        """The step on the Triton path, without the ops' wrappers: one device table per (group, kind) with this
        step's gradients, read by the global norm's partials and by the update's launches; partial sums and
        norms in buffers kept between steps. ``scaling``: ``(found_inf, scale, inv_scale)``, one-element
        device tensors of a gradient scaler; None without one (the flag is then cleared, the threshold a
        number, and the gradients are not multiplied)."""
        from apex._kernels import multi_tensor_l2norm as norm_kernels
        from apex._kernels import multi_tensor_lamb as kernels

        work = []
        for group, (plan, gs, gptrs) in zip(self.param_groups, planned):
            for b in plan.buckets:
                # kind 0: [grads, masters, m, v] and the model parameters as the output; kind 1: [grads, params,
                # m, v]. (The tables depend on nothing else the plan does not fix.)
                tabs = b.held_tables(gs, gptrs, lambda grads, b=b: kernels.tables(
                    grads, *b.lists[:3], b.lists[3] if b.kind == 0 else None))
                work.append((group, b.kind == 0, tabs))
        flag = self._dummy_overflow_buf
        max_grad_norm = float(self.defaults["max_grad_norm"])
        inv_scale = None
        if scaling is None:
            flag.zero_()
        else:
            found_inf, scale, inv_scale = scaling
            flag.copy_(found_inf.reshape(1))
            max_grad_norm = max_grad_norm * scale  # the norm is of the scaled gradients
        scratch = self.__dict__.setdefault("_scratch", {})
        every = [t for _, _, tabs in work for t in tabs]
        grad_norm = norm_kernels.total_of_tables(flag, every, skip_if_flagged=True, scratch=scratch) if every \
            else None
        ok = scratch.get(("ok", device))
        if ok is None:
            ok = scratch[("ok", device)] = torch.empty(1, dtype=torch.bool, device=device)
        torch.ne(flag, 1, out=ok)  # (one op and no new tensor: the steps count up by it)
        for group in self.param_groups:
            if isinstance(group["lr"], (int, float)) or isinstance(group["step"], int):
                self._tensorize(group, device)  # an LR scheduler or a user wrote a Python number
            group["step"] += ok
        if grad_norm is None:  # only empty tensors
            return
        for group, has_out, tabs in work:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            if lr.dtype != torch.float32 or lr.device != device:
                lr = lr.to(device=device, dtype=torch.float32)
            step = group["step"]
            if step.device != device:
                step = step.to(device)
            kernels.lamb_on(flag, tabs, has_out=has_out, lr=lr, beta1=float(beta1), beta2=float(beta2),
                            eps=float(group["eps"]), step=step, bias_correction=bool(group["bias_correction"]),
                            weight_decay=float(group["weight_decay"]),
                            beta3=1.0 - float(beta1) if group["grad_averaging"] else 1.0,
                            adam_w=bool(self.adam_w_mode), grad_norm=grad_norm, max_grad_norm=max_grad_norm,
                            use_nvlamb=bool(self.use_nvlamb), inv_scale=inv_scale, skip_on_noop=True,
                            scratch=scratch)

    def _check_group(self, gi: int, group: dict):
        gg = group_grads("FusedMixedPrecisionLamb", gi, group)
        if len({p.dtype for p in group["params"]}) > 1:
            raise RuntimeError(f"FusedMixedPrecisionLamb: the parameters of param_groups[{gi}] are "
                               "not all of one dtype")
        return gg

    def _build_plan(self, group: dict, checked) -> Plan:
        """State (fp32 moments for parameters with masters), masters, and up to two launches: the
        parameters with fp32 masters (kind 0) and the others (kind 1)."""
        params = checked.params
        plan = Plan(group["params"], params)
        if not params:
            return plan
        if not self.param_groups_full_precision:
            self._setup_full_precision_params()
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        full = self.param_groups_full_precision[gi]["params"]
        if len(full) != len(group["params"]):  # the group's list was changed in place: masters for all
            full = self.param_groups_full_precision[gi]["params"] = self._masters(group)
        master_of = {id(p): m for p, m in zip(group["params"], full)}
        masters = [master_of[id(p)] for p in params]
        states = []
        for p, master in zip(params, masters):
            state = self.state[p]
            if "exp_avg" not in state:
                dtype = torch.float32 if master is not None else p.dtype
                state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
            states.append(state)
        device = params[0].device
        for kind, keep in ((0, [i for i, m in enumerate(masters) if m is not None]),
                           (1, [i for i, m in enumerate(masters) if m is None])):
            if not keep:
                continue
            sel = None if len(keep) == len(params) else keep
            dtype = plan.dtypes[keep[0]]
            b = Bucket(sel, dtype, device, tuple(take(plan.numels, sel)))
            ps = b.column(take(params, sel), take(plan.ptrs, sel), dtype=dtype)
            m = b.column([states[i]["exp_avg"] for i in keep])
            v = b.column([states[i]["exp_avg_sq"] for i in keep])
            b.lists = [b.column([masters[i] for i in keep], dtype=torch.float32), m, v, ps] if kind == 0 \
                else [ps, m, v]
            b.kind = kind
            plan.buckets.append(b)
        return plan

    def _cpu_grad_norm(self, lists: dict, workspaces: dict) -> torch.Tensor:
        """The global gradient norm on the CPU, as ``multi_tensor_l2norm_mp`` computes it (zero when the
        step is already flagged; a non-finite norm flags it), with the reduced-precision gradients
        converted into each list's workspace (``_lamb_cpu.grads_to_workspace``): the lists then hold
        those fp32 copies."""
        flag = self._dummy_overflow_buf
        if bool(flag.item()):
            return torch.zeros(1, dtype=torch.float32)
        norms = []
        for key, lst in lists.items():
            if all(g.dtype == torch.float32 for g in lst[0]):
                norms.append(fp32_norms(lst[0]))
            else:
                lst[0], n = grads_to_workspace(workspaces[key], in_param_shapes(lst[0], lst[1]))
                norms.append(n)
        total = torch.linalg.vector_norm(torch.cat(norms)).reshape(1)
        mark_found_inf(flag, ~torch.isfinite(total))
        return total

    def _workspace_for(self, key: tuple, params: list) -> Workspace:
        """The CPU path's reusable buffers for one list of a group (building them every step costs more
        than the step's arithmetic); kept outside the state dict."""
        ws = self._workspace.get(key)
        if ws is None or not ws.fits(params):
            ws = self._workspace[key] = Workspace.of(params)
        return ws
