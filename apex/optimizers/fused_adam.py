"""``FusedAdam``: Adam and AdamW with one multi-tensor update per (device, dtype) group."""

from __future__ import annotations

import torch

from apex.optimizers._base import FusedOptimizerBase, check_betas, check_non_negative, group_by, trusted


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
    ``master_weights=True`` fp16 and bf16 parameters are updated through an fp32 master copy kept in the
    optimizer state (``master_param``) and receive its rounded value. ``state_dict()`` uses PyTorch's keys
    (``exp_avg``, ``exp_avg_sq``, per-parameter ``step``) so checkpoints move to and from
    ``torch.optim.AdamW``/``Adam``.

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
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    s = st["step"]
                    if not isinstance(s, torch.Tensor):
                        s = torch.tensor(float(s), dtype=torch.float32)
                    st["step"] = s.to(device=p.device if self.capturable else "cpu", dtype=torch.float32)
            if self.capturable:
                self._lr_to_device(group)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                   memory_format=torch.preserve_format)
        if "step" not in state:
            # An Apex checkpoint keeps the step in the group.
            start = float(group.get("step", 0)) if "exp_avg" in state and not isinstance(
                group.get("step", 0), torch.Tensor) else 0.0
            state["step"] = torch.tensor(start, dtype=torch.float32,
                                         device=p.device if self.capturable else "cpu")
        return state

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None,
             grad_scaler=None):
        """Perform one update. ``closure`` re-evaluates the model and returns the loss.

        ``grads``, ``output_params``, ``scale`` and ``grad_norms`` are Apex's deprecated arguments and raise.
        """
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam has been updated.  Simply initialize it identically to "
                               "torch.optim.Adam, and call step() with no arguments.")
        loss = self._run_closure(closure)
        with_grads = self._check_grads()
        if not self.capturable and self._unscale_or_skip(grad_scaler):
            return loss
        for group, params in zip(self.param_groups, with_grads):
            if params:
                self._step_group(group, params, grad_scaler)
        return loss

    def _step_group(self, group: dict, params: list, grad_scaler) -> None:
        beta1, beta2 = group["betas"]
        bias_correction = 1 if group.get("bias_correction", True) else 0
        states = [self._init_state(p, group) for p in params]
        masters = [self._master(p) for p in params]
        device = params[0].device
        if self.capturable:
            info = self._scaler_tensors(grad_scaler, device)
            found, inv_scale = info if info is not None else (
                torch.zeros(1, dtype=torch.float32, device=device),
                torch.ones(1, dtype=torch.float32, device=device))
            noop = self._overflow_buf(device)
            noop.copy_((found != 0).to(torch.int32))
            steps = [s["step"] for s in states]
            steps = [s if s.device == device else s.to(device) for s in steps]
            for st, s in zip(states, steps):
                st["step"] = s
            torch._foreach_add_(steps, (1.0 - (found != 0).float()).reshape(()))
            lr = group["lr"]
            keys = [(p.dtype, m is not None) for p, m in zip(params, masters)]
        else:
            values = self._increment_steps(group, params)
            keys = [(p.dtype, m is not None, v) for p, m, v in zip(params, masters, values)]
        for key, idx in group_by(keys, len(params)).items():
            lists = [[params[i].grad for i in idx], [params[i] for i in idx],
                     [states[i]["exp_avg"] for i in idx], [states[i]["exp_avg_sq"] for i in idx]]
            has_master = key[1]
            if has_master:
                lists.append([masters[i] for i in idx])
            if self.capturable:
                op = (self.multi_tensor_adam_capturable_master if has_master
                      else self.multi_tensor_adam_capturable)
                op(2048 * 32, noop, lists, lr, beta1, beta2, group["eps"], steps[idx[0]], self.adam_w_mode,
                   bias_correction, group["weight_decay"], inv_scale, **trusted(op))
            else:
                self.multi_tensor_adam(2048 * 32, self._overflow_buf(device), lists, group["lr"], beta1,
                                       beta2, group["eps"], int(key[2]), self.adam_w_mode, bias_correction,
                                       group["weight_decay"], **trusted(self.multi_tensor_adam))
