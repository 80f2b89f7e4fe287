"""``FusedLARS``: ROCm Apex's layer-wise adaptive-rate SGD (LARS), one multi-tensor pass per group."""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from apex.optimizers._base import (
    FusedOptimizerBase,
    check_non_negative,
    check_sgd_hyperparameters,
    group_by,
    trusted,
)


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

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one update. ``closure`` re-evaluates the model and returns the loss."""
        loss, checked = self._begin_step(closure)
        if checked is None:
            return loss
        scale = 1.0 / self.most_recent_scale
        for group, (params, _, _) in zip(self.param_groups, checked):
            if not params:
                continue
            momentum = group["momentum"]
            fresh = [momentum != 0 and self.state[p].get("momentum_buffer") is None for p in params]
            keys = [(p.device, p.dtype, f) for p, f in zip(params, fresh)]
            for (device, _, first_run), idx in group_by(keys, len(params)).items():
                ps = [params[i] for i in idx]
                gs = [p.grad for p in ps]
                flag = self._overflow_buf(device)
                flag.zero_()  # a non-finite norm sets it and skips this update only
                w_norms = self.multi_tensor_l2norm(2048 * 32, flag, [ps], True,
                                                   **trusted(self.multi_tensor_l2norm))[1]
                g_norms = self.multi_tensor_l2norm(2048 * 32, flag, [gs], True,
                                                   **trusted(self.multi_tensor_l2norm))[1] * abs(scale)
                if momentum != 0:
                    for p in ps:
                        if self.state[p].get("momentum_buffer") is None:
                            self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                    bufs = [self.state[p]["momentum_buffer"] for p in ps]
                else:
                    bufs = ps  # untouched without momentum
                self.multi_tensor_lars(2048 * 32, flag, [gs, ps, bufs], g_norms, w_norms, group["lr"],
                                       group["trust_coefficient"], group["eps"], group["weight_decay"], momentum,
                                       group["dampening"], group["nesterov"], first_run, self.wd_after_momentum,
                                       scale, bool(group.get("is_skipped", False)),
                                       **trusted(self.multi_tensor_lars))
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss


Fused_LARS = FusedLARS  # ROCm Apex's class name
