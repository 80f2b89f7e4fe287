"""``FP16_Optimizer``: Apex's legacy wrapper keeping fp32 master weights for a half model.

It wraps any ``torch.optim`` optimizer whose parameters are half (fp16/bf16) and/or fp32 tensors: half
parameters are replaced inside the optimizer by fp32 masters; ``backward(loss)`` scales the loss, runs the
backward pass and unscales the half gradients into the masters' gradients with one fused, sync-free
check for infs/NaNs; ``step()`` skips the update on overflow (dynamic scaling) or updates the masters and
copies them back to the model. The scaler is amp's :class:`apex.amp.scaler.LossScaler`:
``dynamic_loss_args`` accepts ``init_scale``, ``scale_factor``, ``scale_window``, ``min_loss_scale`` and
``max_loss_scale``.
"""

from __future__ import annotations

import warnings

import torch

from apex.fp16_utils._scaling import LossScaler, copy_masters_to_model
from apex.fp16_utils.fp16util import _masters_for_group, clip_grad_norm

_HALF = (torch.float16, torch.bfloat16)


class FP16_Optimizer:
    """Apex's legacy master-weights wrapper: ``FP16_Optimizer(init_optimizer, static_loss_scale=1.0,
    dynamic_loss_scale=False, dynamic_loss_args=None, verbose=True)``.

    The wrapped optimizer's fp16/bf16 parameters get fp32 master copies, which the wrapped optimizer updates;
    ``backward(loss)`` scales the loss, ``step()`` unscales the gradients into the masters, skips the step
    when they overflowed (dynamic scaling halves the scale then), and copies the masters back to the model.
    ``clip_master_grads(max_norm)``, ``state_dict``/``load_state_dict`` and ``loss_scale`` as in Apex.
    Raises ``TypeError`` when ``init_optimizer`` is not a ``torch.optim.Optimizer``.
    """
    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 verbose: bool = True):
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError("init_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(init_optimizer).__name__}")
        warnings.warn("FP16_Optimizer is deprecated; for mixed precision use apex.amp "
                      "(amp.initialize with opt_level='O1' or 'O2').", DeprecationWarning, stacklevel=2)
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups = [], [], []
        for i, param_group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {i}:")
            fp16_this, fp32_this, master_this = _masters_for_group(
                param_group, self.optimizer.state, "Wrapped parameters",
                on_param=lambda p: self.maybe_print(f"FP16_Optimizer received {p.type()} with {p.size()}"))
            self.fp16_groups.append(fp16_this)
            self.fp32_from_fp16_groups.append(master_this)
            self.fp32_from_fp32_groups.append(fp32_this)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        self.optimizer.load_state_dict(self.optimizer.state_dict())

        device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), None)
        if dynamic_loss_scale:
            self.dynamic_loss_scale = True
            self.loss_scaler = LossScaler("dynamic", device=device, **(dynamic_loss_args or {}))
        else:
            self.dynamic_loss_scale = False
            self.loss_scaler = LossScaler(static_loss_scale, device=device)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device or "cpu")

    def maybe_print(self, msg: str) -> None:
        if self.verbose:
            print(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero (or drop) the gradients of the masters and of the model's half parameters."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self._zero(p, set_grads_to_None)
        for p in self.all_fp16_params:
            self._zero(p, set_grads_to_None)

    @staticmethod
    def _zero(p, to_none: bool) -> None:
        if to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.detach_()
            p.grad.zero_()

    def _master_params_to_model_params(self) -> None:
        copy_masters_to_model(self._dummy_overflow_buf, self.all_fp32_from_fp16_params, self.all_fp16_params)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2):
        """Clip the fp32 master gradients; returns their total norm, or -1 after an overflow."""
        if self.overflow:
            return -1
        fp32_params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return self.clip_grad_norm(fp32_params, max_norm, norm_type)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, the loss scaler's and the fp32 masters (tensors and numbers)."""
        s = self.loss_scaler
        return {
            "loss_scaler": {"loss_scale": s.loss_scale(), "dynamic": s.dynamic, "unskipped": s._unskipped,
                            "scale_window": s._scale_seq_len, "scale_factor": s._scale_factor,
                            "min_loss_scale": s._min_loss_scale, "max_loss_scale": s._max_loss_scale},
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` (after ``model.load_state_dict``); masters are copied exactly."""
        saved = state_dict["loss_scaler"]
        if isinstance(saved, dict):
            s = LossScaler("dynamic" if saved["dynamic"] else saved["loss_scale"],
                           scale_factor=saved.get("scale_factor", 2.0),
                           scale_window=saved.get("scale_window", 2000),
                           min_loss_scale=saved.get("min_loss_scale"),
                           max_loss_scale=saved.get("max_loss_scale", 2.0 ** 24),
                           device=self._dummy_overflow_buf.device)
            s._loss_scale = float(saved["loss_scale"])
            s._unskipped = int(saved["unskipped"])
            self.loss_scaler = s
        else:  # an Apex checkpoint holding the scaler object itself
            self.loss_scaler = saved
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"]):
                for current, saved_t in zip(current_group, saved_group):
                    current.data.copy_(saved_t.data)

    def step(self, closure=None):
        """Update the masters with the wrapped optimizer and copy them to the model; skipped on overflow."""
        if self.overflow:
            print("Gradient overflow.  Skipping step, reducing "
                  f"loss scale to {self.loss_scaler.loss_scale()}")
            return None
        if closure is not None:
            retval = self._step_with_closure(closure)
        else:
            retval = self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure):
        def wrapped_closure():
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._master_params_to_model_params()
            temp_loss = closure()
            while self.overflow:
                print("OVERFLOW within closure! Skipping step, reducing loss scale to "
                      f"{self.loss_scaler.loss_scale()}")
                temp_loss = closure()
            return temp_loss

        retval = self.optimizer.step(wrapped_closure)
        self.first_closure_call_this_step = True
        return retval

    def backward(self, loss, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``, then (by default) :meth:`update_master_grads`."""
        scaled_loss = loss.float() * self.loss_scaler.loss_scale()
        scaled_loss.backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model gradients into the masters' gradients and update the loss scale."""
        self.loss_scaler.clear_overflow_state()
        model_grads, master_grads = [], []
        for model_param, master_param in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model_param.grad is not None:
                model_grads.append(model_param.grad)
                if master_param.grad is None:
                    master_param.grad = torch.empty_like(master_param)
                master_grads.append(master_param.grad)
        for p in self.all_fp32_from_fp32_params:
            if p.grad is not None:
                model_grads.append(p.grad)
                master_grads.append(p.grad)
        if model_grads:
            self.loss_scaler.unscale(model_grads, master_grads, self.loss_scaler.loss_scale())
        self.overflow = self.loss_scaler.update_scale()

    def inspect_master_grad_data(self):
        """Per parameter group, the masters' gradient tensors (None after an overflow)."""
        if self.overflow:
            print("Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.  "
                  "Gradients are currently invalid (may be inf, nan, or stale).  Returning None.")
            return None
        return [[p.grad.data if p.grad is not None else None for p in g["params"]]
                for g in self.optimizer.param_groups]

    def _get_loss_scale(self) -> float:
        return self.loss_scaler.loss_scale()

    def _set_loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = value

    loss_scale = property(_get_loss_scale, _set_loss_scale)

    def _get_state(self):
        return self.optimizer.state

    def _set_state(self, value) -> None:
        self.optimizer.state = value

    state = property(_get_state, _set_state)

    def _get_param_groups(self):
        return self.optimizer.param_groups

    def _set_param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    param_groups = property(_get_param_groups, _set_param_groups)
