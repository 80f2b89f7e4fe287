"""Machinery shared by apex's fused optimizers.

* hyper-parameter validation (``ValueError`` naming the argument: :mod:`apex.optimizers._validation`);
* a whole-step check of every gradient before anything is changed (sparse, dtype, shape, device);
* grouping of tensors by (device, dtype) so each group costs one multi-tensor call;
* fp32 master weights for fp16 *and* bf16 parameters, kept in the per-parameter state (``master_param``)
  so that they are saved by ``state_dict()`` and a resumed run continues bit for bit
  (:mod:`apex.optimizers._masters`);
* ``zero_grad`` honouring Apex's ``set_grad_none`` (with the ``step`` wrapper, the closure and copies:
  :mod:`apex.optimizers._optimizer_protocol`);
* mixed-precision scaling: ``step(grad_scaler=...)`` (Apex's protocol) and the ``grad_scale`` /
  ``found_inf`` attributes that ``torch.amp.GradScaler`` sets on optimizers (PyTorch's protocol);
* a ``load_state_dict`` that keeps fp32 optimizer state fp32 for reduced-precision parameters
  (``torch.optim.Optimizer`` would cast it to the parameter's dtype and lose the bits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch

from apex.optimizers._grad_scaler import scaler_state
from apex.optimizers._masters import REDUCED, MasterWeights  # noqa: F401

# The optimizers import these from here: the hyper-parameter checks and torch.optim's protocol have their own
# modules.
from apex.optimizers._optimizer_protocol import (  # noqa: F401
    CopyableOptimizer,
    fused_step,
    run_closure,
    trusted,
    zero_grad,
)
from apex.optimizers._plan import Plan, step_plans
from apex.optimizers._validation import (  # noqa: F401
    _number,
    check_betas,
    check_non_negative,
    check_sgd_hyperparameters,
)

# float64 parameters are accepted as Apex's kernels accept them: the update is computed in fp32.
SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# -- tensor checks ---------------------------------------------------------------------------------------
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


class FusedOptimizerBase(MasterWeights, CopyableOptimizer):
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
