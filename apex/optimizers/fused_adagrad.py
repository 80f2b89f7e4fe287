"""``FusedAdagrad``: Adagrad with one multi-tensor update per (device, dtype) group."""

from __future__ import annotations

import torch

from apex.optimizers._base import FusedOptimizerBase, check_non_negative, group_by, trusted


class FusedAdagrad(FusedOptimizerBase):
    r"""Adagrad, Apex's ``FusedAdagrad``; a drop-in replacement for ``torch.optim.Adagrad``.

    ::

        L2 (adagrad_w_mode=False):  g = g + weight_decay * p ;  sum += g² ;  p -= lr * g / (sqrt(sum) + eps)
        decoupled (adagrad_w_mode=True):  sum += g² ;  p -= lr * (g / (sqrt(sum) + eps) + weight_decay * p)

    Arithmetic is fp32; ``sum`` has the parameter's dtype (as in Apex and PyTorch). The state uses
    PyTorch's keys (``sum``, ``step``), so checkpoints move to and from ``torch.optim.Adagrad``.

    Arguments are Apex's: ``params, lr=1e-2, eps=1e-10, weight_decay=0., set_grad_none=True,
    adagrad_w_mode=False``.
    """

    _name = "FusedAdagrad"

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False):
        check_non_negative(lr, "lr")
        check_non_negative(eps, "eps")
        check_non_negative(weight_decay, "weight_decay")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=0.0, initial_accumulator_value=0.0,
                        foreach=None, maximize=False, differentiable=False, fused=None)
        super().__init__(params, defaults, set_grad_none=set_grad_none)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0

        import amp_C

        self.multi_tensor_adagrad = amp_C.multi_tensor_adagrad

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one update. ``closure`` re-evaluates the model and returns the loss."""
        loss, checked = self._begin_step(closure)
        if checked is None:
            return loss
        for group, (params, grads, dtype) in zip(self.param_groups, checked):
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
            self._increment_steps(group, params)
            sums = [self.state[p]["sum"] for p in params]
            if dtype is not None:  # one dtype (and one device): one call on the lists as they are
                buckets = {(params[0].device, dtype): None}
            else:
                buckets = group_by([(p.device, p.dtype) for p in params], len(params))
            for (device, _), idx in buckets.items():
                lists = ([grads, params, sums] if idx is None
                         else [[lst[i] for i in idx] for lst in (grads, params, sums)])
                self.multi_tensor_adagrad(2048 * 32, self._overflow_buf(device), lists, group["lr"], group["eps"],
                                          self.adagrad_w_mode, group["weight_decay"],
                                          **trusted(self.multi_tensor_adagrad))
        return loss
