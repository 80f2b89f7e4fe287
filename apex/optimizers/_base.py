"""Machinery shared by apex's fused optimizers.

* hyper-parameter validation (``ValueError`` naming the argument);
* a whole-step check of every gradient before anything is changed (sparse, dtype, shape, device);
* grouping of tensors by (device, dtype) so each group costs one multi-tensor call;
* fp32 master weights for fp16 *and* bf16 parameters, kept in the per-parameter state (``master_param``)
  so that they are saved by ``state_dict()`` and a resumed run continues bit for bit;
* ``zero_grad`` honouring Apex's ``set_grad_none``;
* mixed-precision scaling: ``step(grad_scaler=...)`` (Apex's protocol) and the ``grad_scale`` /
  ``found_inf`` attributes that ``torch.amp.GradScaler`` sets on optimizers (PyTorch's protocol);
* a ``load_state_dict`` that keeps fp32 optimizer state fp32 for reduced-precision parameters
  (``torch.optim.Optimizer`` would cast it to the parameter's dtype and lose the bits).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch.optim import optimizer as _torch_optimizer
from torch.optim.optimizer import required

from apex.optimizers._grad_scaler import scaler_state
from apex.optimizers._plan import Plan, step_plans

REDUCED = (torch.float16, torch.bfloat16)
# float64 parameters are accepted as Apex's kernels accept them: the update is computed in fp32.
SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# -- validation -----------------------------------------------------------------------------------------
def _number(value, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got {value.numel()} elements")
        return float(value.detach().cpu().item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def check_non_negative(value, name: str) -> None:
    v = _number(value, name)
    if not v >= 0.0 or math.isinf(v):
        raise ValueError(f"Invalid {name}: {value!r} (expected a finite number >= 0)")


def check_betas(betas, name: str = "betas") -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {name}: {betas!r} (expected a pair (beta1, beta2))")
    for i, b in enumerate(betas):
        v = _number(b, f"{name}[{i}]")
        if not 0.0 <= v < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b!r} ({name}[{i}] must be in [0, 1))")


def check_sgd_hyperparameters(lr, momentum, dampening, weight_decay, nesterov) -> None:
    """The arguments FusedSGD and FusedLARS share (``lr`` may be ``torch.optim.optimizer.required``)."""
    if lr is not required:
        check_non_negative(lr, "lr")
    check_non_negative(momentum, "momentum")
    check_non_negative(weight_decay, "weight_decay")
    check_non_negative(dampening, "dampening")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill one block of memory in some order."""
    if t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# -- helpers ----------------------------------------------------------------------------------------------
def fused_step(func: Callable) -> Callable:
    """Decorator for a fused optimizer's ``step``: gradients off (``torch.no_grad``) and ``torch.optim``'s
    step hooks, as ``torch.optim.Optimizer`` wraps every ``step``; the profiler's ``Optimizer.step#...``
    range is opened only while a profiler runs (entering it costs as much as a step of ~100 parameters).
    With any step hook registered the call goes through PyTorch's own wrapper, unchanged."""

    @functools.wraps(func)
    def no_grad(*args, **kwargs):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return func(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(prev)

    hooked = torch.optim.Optimizer.profile_hook_step(no_grad)

    @functools.wraps(func)
    def step(self, *args, **kwargs):
        if (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                or _torch_optimizer._global_optimizer_pre_hooks or _torch_optimizer._global_optimizer_post_hooks
                or torch._C._autograd._profiler_enabled()):
            return hooked(self, *args, **kwargs)
        return no_grad(self, *args, **kwargs)

    step.hooked = True  # torch.optim.Optimizer.__init__ then leaves it as it is
    return step


def trusted(op) -> dict:
    """``validate=False`` for apex's own ops (the step already checked every tensor); nothing for an op a
    subclass swapped in."""
    return {"validate": False} if getattr(op, "__module__", "").startswith("apex.ops.") else {}


def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool | None) -> None:
    """Clear gradients: ``None`` when ``set_to_none`` (default: the optimizer's ``set_grad_none``), else
    zeros."""
    if set_to_none is None:
        set_to_none = optimizer.set_grad_none
    torch.optim.Optimizer.zero_grad(optimizer, set_to_none=bool(set_to_none))


def run_closure(closure: Callable | None):
    """``closure()`` with gradients enabled (``step`` runs under ``no_grad``), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Checked(NamedTuple):
    """One parameter group after the step's checks: its parameters with a gradient, the gradients, and
    the group's dtype (``None`` when it mixes dtypes)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    dtype: torch.dtype | None


def group_by(keys: Sequence, n: int) -> dict:
    """Indices ``0..n-1`` bucketed by ``keys[i]`` (insertion ordered)."""
    buckets: dict = {}
    for i in range(n):
        buckets.setdefault(keys[i], []).append(i)
    return buckets


# Caches an optimizer rebuilds on use: left out of its pickled state.
_CACHES = ("_workspace", "_packed_steps", "_overflow_bufs", "_pending_masters", "_plans")


class CopyableOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``, so
    a ``copy.deepcopy`` or a pickle of an optimizer would lose every attribute its constructor set (the
    copy fails at its first step). This keeps them all but the hooks (which PyTorch leaves out too) and
    the caches."""

    def __getstate__(self) -> dict:
        # Also left out: what amp.initialize attached (its stash, and methods bound to this object, which
        # a pickle cannot restore); the copy is the optimizer as constructed, as with torch.optim.
        return {k: v for k, v in self.__dict__.items()
                if not k.startswith(("_optimizer_", "_amp_")) and k not in _CACHES
                and not (isinstance(v, types.MethodType) and v.__self__ is self)}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for key in _CACHES:
            self.__dict__.setdefault(key, {})
        self._plans = {}

    # A step plan (apex.optimizers._plan) describes the param groups and state as they were: both of these
    # change them.
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._plans = {}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._plans = {}


class FusedOptimizerBase(CopyableOptimizer):
    """Base class: validation, master weights, ``zero_grad``, scaler protocol and state loading.

    Subclasses implement ``_fused_step(grad_scale_info)`` and list, in ``_fp32_state_keys``, the state
    entries that stay fp32 whatever the parameter dtype.
    """

    _fp32_state_keys: tuple[str, ...] = ("master_param",)
    _name = "FusedOptimizer"

    def __init__(self, params, defaults: dict, *, set_grad_none: bool, master_weights: bool = False):
        super().__init__(params, defaults)
        self.set_grad_none = bool(set_grad_none)
        self.master_weights = bool(master_weights)
        self._overflow_bufs: dict = {}
        self._packed_steps: dict = {}
        self._plans: dict = {}
        # torch.amp.GradScaler.step then hands itself to step(grad_scaler=...), which checks the gradients
        # with apex's own kernel on GPUs (PyTorch's CUDA unscale has no bf16 kernel): see scaler_state.
        self._step_supports_amp_scaling = True

    # -- Apex attributes --------------------------------------------------------------------------------
    @property
    def _dummy_overflow_buf(self) -> torch.Tensor:
        """Apex's skip flag (int32, one element) on the device of the first parameter."""
        return self._overflow_buf(self._first_device())

    def _overflow_buf(self, device: torch.device) -> torch.Tensor:
        buf = self._overflow_bufs.get(device)
        if buf is None:
            buf = self._overflow_bufs[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return buf

    def _first_device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._rebuild_pending_masters()
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)

    # -- zero_grad --------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients: ``None`` when ``set_grad_none`` (or ``set_to_none``) is true, else zeros."""
        zero_grad(self, set_to_none)

    # -- checks -----------------------------------------------------------------------------------------
    def _check_grads(self) -> list[list[torch.Tensor]]:
        """Check every gradient of every group before any state changes; return params with grads."""
        return [c.params for c in self._checked_groups()]

    def _checked_groups(self) -> list[Checked]:
        """Check every gradient of every group before any state changes (one pass over the tensors).

        Returns, per group, its parameters that have a gradient, those gradients (made contiguous where
        they were strided) and the group's one dtype (``None`` when the dtypes are mixed), so that a step
        does not read these attributes again.
        """
        relayout: list = []
        out = [self._check_group(gi, group, relayout) for gi, group in enumerate(self.param_groups)]
        self._relayout(relayout)
        return out

    @staticmethod
    def _relayout(relayout: list) -> None:
        for gs, i, p in relayout:  # only once every check has passed: a failed step changes nothing
            p.grad = gs[i] = torch.empty_like(p).copy_(p.grad)

    def _check_group(self, gi: int, group: dict, relayout: list) -> Checked:
        """The checks of :meth:`_checked_groups` for one group; strided gradients to replace by contiguous
        ones are appended to ``relayout`` (done by the caller once every group has passed)."""
        ps: list[torch.Tensor] = []
        gs: list[torch.Tensor] = []
        device = dtype = None
        mixed = False
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            pdtype, pdevice = p.dtype, p.device
            # One cheap test for the usual case; the detailed checks run only when it fails.
            if (g.is_sparse or pdtype not in SUPPORTED or g.dtype != pdtype or g.shape != p.shape
                    or g.device != pdevice or not p.is_contiguous()):
                self._diagnose(gi, pi, p, g)
                if g.stride() != p.stride() and p.numel() > 1:
                    relayout.append((gs, len(gs), p))  # the kernels walk p, g and the state in one order
            elif not g.is_contiguous() and p.numel() > 1:
                relayout.append((gs, len(gs), p))
            if device is None:
                device, dtype = pdevice, pdtype
            else:
                if pdevice != device:
                    raise RuntimeError(f"{self._name}: the parameters of a group are not on the same device: "
                                       f"param_groups[{gi}]['params'][{pi}] is on {pdevice}, the group's "
                                       f"first parameter on {device}")
                mixed = mixed or pdtype is not dtype
            ps.append(p)
            gs.append(g)
        return Checked(ps, gs, None if mixed else dtype)

    # -- step plans ------------------------------------------------------------------------------------------
    def _plan_mode(self) -> tuple:
        """Options a plan depends on (a plan built under other values is rebuilt)."""
        return ()

    def _build_plan(self, group: dict, checked: Checked) -> Plan:
        """A plan for ``group`` from its checked parameters (creating their state): subclasses."""
        raise NotImplementedError

    def _step_plans(self) -> list[tuple[Plan, list, tuple]]:
        """Per group, ``(plan, gradients, their addresses)`` for this step (see :mod:`apex.optimizers._plan`)."""
        relayout: list = []
        return step_plans(self, self._plan_mode(), lambda gi, group: self._check_group(gi, group, relayout),
                          self._build_plan, lambda: self._relayout(relayout))

    def _diagnose(self, gi: int, pi: int, p: torch.Tensor, g: torch.Tensor) -> None:
        """Raise the error for a parameter/gradient pair that failed the fast check (or accept a dense,
        non-contiguous parameter such as a channels_last one)."""
        where = f"param_groups[{gi}]['params'][{pi}]"
        if g.is_sparse:
            raise RuntimeError(f"{self._name} does not support sparse gradients ({where})")
        if p.dtype not in SUPPORTED:
            raise RuntimeError(f"{self._name} supports float32, float16, bfloat16 and float64 "
                               f"parameters; {where} is {p.dtype}")
        if g.dtype != p.dtype:
            raise RuntimeError(f"{self._name}: the gradient of {where} has dtype {g.dtype} but the "
                               f"parameter has dtype {p.dtype}")
        if g.shape != p.shape:
            raise RuntimeError(f"{self._name}: the gradient of {where} has shape {tuple(g.shape)} "
                               f"but the parameter has shape {tuple(p.shape)}")
        if g.device != p.device:
            raise RuntimeError(f"{self._name}: the gradient of {where} is on {g.device} but the "
                               f"parameter is on {p.device}")
        if not _dense(p):
            raise RuntimeError(f"{self._name}: {where} is not a dense tensor (a strided view?); "
                               "optimize the tensor it views instead")

    # -- master weights -----------------------------------------------------------------------------------
    def _init_masters(self) -> None:
        """Apex's ``param_groups_master``: for each group, ``{"params": [its parameters' masters]}`` (fp32
        copies of fp16/bf16 parameters; an fp32 parameter is its own master; all None without master
        weights)."""
        self._pending_masters: dict = {}
        self.param_groups_master = [self._group_masters(g) for g in self.param_groups]

    def _group_masters(self, group: dict) -> dict:
        return {"params": [self._new_master(p) for p in group["params"]]}

    def _new_master(self, p: torch.Tensor) -> torch.Tensor | None:
        if not self.master_weights:
            return None
        if p.dtype not in REDUCED:
            return p
        m = p.detach().to(torch.float32, copy=True)
        self._remember_master(p, m)
        return m

    def _remember_master(self, p: torch.Tensor, m: torch.Tensor) -> None:
        # Until the first step adopts the master, the version counters tell whether the parameter (weights
        # loaded into the model) or the master (set by the user) was written in between.
        self._pending_masters[id(p)] = (m, p._version, m._version)

    def _rebuild_pending_masters(self) -> None:
        """After unpickling: the masters not yet adopted by a step are pending again (keyed by the new
        parameters, with the versions they have now)."""
        self._pending_masters = {}
        for group, masters in zip(self.param_groups, getattr(self, "param_groups_master", [])):
            for p, m in zip(group["params"], masters["params"]):
                if m is not None and m is not p and "master_param" not in self.state.get(p, {}):
                    self._remember_master(p, m)

    def _master(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master copy of a reduced-precision parameter (kept in the state as ``master_param``
        from the first step on), else None."""
        if not self.master_weights or p.dtype not in REDUCED:
            return None
        state = self.state[p]
        m = state.get("master_param")
        if m is None or m.shape != p.shape or m.device != p.device:
            m = state["master_param"] = self._adopt_master(p)
        return m

    def _adopt_master(self, p: torch.Tensor) -> torch.Tensor:
        """The master made at construction, refreshed from the parameter if that was written in place since
        (weights loaded into the model) and the master was not; else a new copy of the parameter (then
        ``param_groups_master`` is updated). A write through ``.data`` moves no version counter: such a
        write to the master keeps it, as Apex always keeps it."""
        pending = getattr(self, "_pending_masters", {}).pop(id(p), None)
        if pending is not None:
            m, p_version, m_version = pending
            if m.shape == p.shape and m.device == p.device:
                if p._version != p_version and m._version == m_version:
                    m.copy_(p)
                return m
        self._masters_stale = True
        return p.detach().to(torch.float32, copy=True)

    def _sync_masters(self) -> None:
        """Point ``param_groups_master`` at the state's masters (after a load, or a master made anew)."""
        self._masters_stale = False
        if not hasattr(self, "param_groups_master"):
            return
        rows = []
        for gi, group in enumerate(self.param_groups):
            old = self.param_groups_master[gi]["params"] if gi < len(self.param_groups_master) else []
            row = []
            for pi, p in enumerate(group["params"]):
                st = self.state.get(p)
                m = st.get("master_param") if st else None
                if m is not None and self.master_weights and p.dtype in REDUCED:
                    getattr(self, "_pending_masters", {}).pop(id(p), None)
                elif pi < len(old) and (old[pi] is None) == (not self.master_weights):
                    m = old[pi]
                else:
                    m = self._new_master(p)
                row.append(m)
            rows.append({"params": row})
        self.param_groups_master = rows

    # -- step counters ---------------------------------------------------------------------------------------
    def _increment_steps(self, group: dict, params: list[torch.Tensor]) -> list[float]:
        """Add 1 to the (CPU, fp32) ``state['step']`` of each of ``params`` and return the new values.

        The steps of a group are kept as 0-d views of one buffer, so the usual step (every parameter of
        the group has a gradient) costs one ``add_`` and no read-back, instead of a foreach over one
        scalar tensor per parameter. Each ``state['step']`` is still its own tensor, as in PyTorch.
        Anything else (a subset of the group, steps loaded or modified from outside, detected through
        the buffer's version counter) takes the general path and re-packs the steps.
        """
        key = id(group)
        packed = self._packed_steps.get(key)
        states = [self.state[p] for p in params]
        if packed is not None:
            buf, views, values, version = packed
            if (buf._version == version and len(views) == len(states)
                    and all(st["step"] is v for st, v in zip(states, views))):
                buf.add_(1.0)
                values = [v + 1.0 for v in values]
                self._packed_steps[key] = (buf, views, values, buf._version)
                return values
        steps = [st["step"] for st in states]
        # Steps may come from elsewhere as Python numbers or tensors of any dtype/device.
        read = torch.stack([torch.as_tensor(s).detach().reshape(()).to("cpu", torch.float32) for s in steps])
        values = [v + 1.0 for v in read.tolist()]
        buf = torch.tensor(values, dtype=torch.float32)
        views = [buf[i] for i in range(len(values))]
        for st, v in zip(states, views):
            st["step"] = v
        self._packed_steps[key] = (buf, views, values, buf._version)
        return values

    def _pack_steps(self, states: list[dict], device: torch.device) -> tuple[torch.Tensor, list[float] | None]:
        """Every ``state['step']`` of ``states`` as a 0-d view of one fp32 buffer on ``device``, so that a step
        adds 1 to all of them with one op (each is still its own tensor in the state, as in PyTorch). Returns
        the buffer and, on the CPU, the values (read without a host synchronisation on a GPU buffer)."""
        steps = [st["step"] for st in states]
        # Steps may come from elsewhere as Python numbers or tensors of any dtype/device.
        buf = torch.stack([torch.as_tensor(s).detach().reshape(()).to(device, torch.float32) for s in steps])
        values = buf.tolist() if device.type == "cpu" else None
        for st, v in zip(states, buf.unbind(0)):
            st["step"] = v
        return buf, values

    # -- mixed-precision scaling --------------------------------------------------------------------------
    def _scaler_tensors(self, grad_scaler, device: torch.device, grads: list | None = None):
        """``(found_inf, inv_scale)`` as fp32 one-element tensors on ``device``, or ``None`` without scaler.

        With ``grad_scaler`` (Apex's protocol) the gradients are checked here unless the user already
        called ``grad_scaler.unscale_(optimizer)``, in which case they are already unscaled. Otherwise
        ``torch.amp.GradScaler``'s ``grad_scale``/``found_inf`` attributes are used when present.
        """
        if grad_scaler is not None:
            found, scale = scaler_state(self, grad_scaler, device, grads)
            return found, scale.double().reciprocal().float()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is None and found_inf is None:
            return None
        found = (found_inf.to(device=device, dtype=torch.float32).reshape(1) if found_inf is not None
                 else torch.zeros(1, dtype=torch.float32, device=device))
        inv_scale = (grad_scale.double().reciprocal().float().to(device).reshape(1) if grad_scale is not None
                     else torch.ones(1, dtype=torch.float32, device=device))
        return found, inv_scale

    def _no_scaling(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(found_inf = 0, inv_scale = 1)`` on ``device`` for a capturable step without a scaler (made once:
        the update only reads them)."""
        consts = self.__dict__.setdefault("_overflow_bufs", {}).get(("no scaling", device))
        if consts is None:
            consts = self._overflow_bufs[("no scaling", device)] = (
                torch.zeros(1, dtype=torch.float32, device=device), torch.ones(1, dtype=torch.float32, device=device))
        return consts

    def _unscale_or_skip(self, grad_scaler, planned: list | None = None) -> bool:
        """Host-synchronising scaler handling for non-capturable optimizers: returns True to skip the step
        (an inf/NaN was found), otherwise unscales the gradients (those of ``planned``, the step's
        :meth:`_step_plans`, default: every parameter's) in place."""
        if grad_scaler is None and getattr(self, "grad_scale", None) is None \
                and getattr(self, "found_inf", None) is None:
            return False  # (the usual step: nothing to read)
        step_grads = None if planned is None else [b.grads(gs, gptrs) for plan, gs, gptrs in planned
                                                   for b in plan.buckets]
        info = self._scaler_tensors(grad_scaler, self._first_device(), step_grads)
        if info is None:
            return False
        found, inv_scale = info
        if found.item() != 0:
            return True
        if inv_scale.item() != 1.0:
            if step_grads is None:
                step_grads = [[p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]]
            for grads in step_grads:
                one = getattr(grads, "device", None)  # (a plan's Column knows its device)
                by_dev = ({one or grads[0].device: grads} if one or all(g.device == grads[0].device for g in grads)
                          else {g.device: [h for h in grads if h.device == g.device] for g in grads})
                for dev, gs in by_dev.items():
                    torch._foreach_mul_(list(gs), inv_scale.to(dev).reshape(()))
        return False

    # -- step ---------------------------------------------------------------------------------------------
    def _run_closure(self, closure: Callable | None):
        return run_closure(closure)

    def _begin_step(self, closure: Callable | None):
        """The start of a host-synchronising step: ``(loss, checked groups)``, or ``(loss, None)`` when a
        non-finite gradient makes the step a no-op."""
        loss = run_closure(closure)
        checked = self._checked_groups()
        return loss, None if self._unscale_or_skip(None) else checked

    # -- state loading ------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict (ours, Apex's or ``torch.optim``'s), keeping fp32 state fp32."""
        saved_state = state_dict["state"]
        keep: dict = {}
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, ids):
            st = saved_state.get(i)
            if not st:
                continue
            for key in self._fp32_state_keys:
                v = st.get(key)
                if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
                    keep[(id(p), key)] = v
        super().load_state_dict(state_dict)
        self._packed_steps = {}
        for p in params:
            st = self.state.get(p)
            if not st:
                continue
            for key in self._fp32_state_keys:
                v = keep.get((id(p), key))
                if v is not None:
                    st[key] = v.detach().to(device=p.device, dtype=torch.float32, copy=True)
        self._after_load()

    def _after_load(self) -> None:
        """Hook for subclasses (e.g. moving ``step`` tensors to the device in capturable mode)."""


def flat_params(groups: Iterable[dict]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]
