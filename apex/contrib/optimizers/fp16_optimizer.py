"""Apex's contrib ``FP16_Optimizer``: the cut-down fp16 wrapper for the legacy contrib optimizers
(``apex.contrib.optimizers.FusedAdam`` and ``FusedSGD``), whose ``step`` takes the fp16 gradients, the loss
scale and the gradient norms and writes the fp16 model weights itself.

One iteration::

    backward(loss)    (loss.float() * cur_scale).backward()      fp16 gradients, scaled
    step()            norms of the fp16 gradients (fp32 accumulation); if any is inf/NaN: skip, and with
                      dynamic scaling cur_scale = max(cur_scale / 2, 1); else
                      optimizer.step(grads=fp16 grads, output_params=fp16 params, scale=cur_scale,
                      grad_norms=norms) updates the fp32 masters and writes them back into the fp16 params,
                      and with dynamic scaling cur_scale *= 2 every ``scale_window`` clean iterations

Dtype policy: the wrapped optimizer's parameters become fp32 master copies of the model's (fp16)
parameters; the model keeps its dtype. Differences from upstream: the banner is printed only when
``verbose``; ``dynamic_loss_args`` is honoured (keys ``init_scale``, ``scale_factor``, ``scale_window``)
instead of raising; parameters without a gradient are left out of the overflow check.
"""

from __future__ import annotations

import torch

from apex.ops.multi_tensor_l2norm import multi_tensor_l2norm

_CHUNK = 2048 * 32
_DYNAMIC_KEYS = ("init_scale", "scale_factor", "scale_window")


class FP16_Optimizer:
    """Loss scaling and fp32 master weights around a legacy contrib optimizer (see the module docstring).

    Arguments: ``init_optimizer`` (a contrib ``FusedAdam``/``FusedSGD`` built on the fp16 parameters),
    ``static_loss_scale`` (1.0), ``dynamic_loss_scale`` (False; True starts at 2**16, halves on overflow,
    doubles every 1000 clean iterations), ``dynamic_loss_args`` (None, or a dict overriding ``init_scale``,
    ``scale_factor``, ``scale_window``), ``verbose`` (True: print the banner and overflow messages)."""

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None, verbose: bool = True):
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"init_optimizer must be a torch.optim.Optimizer, got {type(init_optimizer).__name__}")
        if not static_loss_scale > 0:
            raise ValueError(f"static_loss_scale must be > 0, got {static_loss_scale!r}")
        args = dict(init_scale=2.0 ** 16, scale_factor=2.0, scale_window=1000)
        if dynamic_loss_args is not None:
            if not isinstance(dynamic_loss_args, dict) or set(dynamic_loss_args) - set(_DYNAMIC_KEYS):
                raise ValueError(f"dynamic_loss_args must be a dict with keys among {_DYNAMIC_KEYS}, "
                                 f"got {dynamic_loss_args!r}")
            args.update(dynamic_loss_args)
            if not args["init_scale"] > 0 or not args["scale_factor"] > 1 or int(args["scale_window"]) < 1:
                raise ValueError(f"dynamic_loss_args need init_scale > 0, scale_factor > 1, scale_window >= 1; "
                                 f"got {dynamic_loss_args!r}")
        if verbose:
            print("\nThis fp16_optimizer is designed to only work with apex.contrib.optimizers.*")
            print("To update, use updated optimizers with AMP.")
        self.optimizer = init_optimizer
        self.fp16_groups = []  # the model's parameters
        self.fp32_groups = []  # the masters the wrapped optimizer updates
        for group in self.optimizer.param_groups:
            fp16 = list(group["params"])
            fp32 = [p.detach().clone().float() for p in fp16]
            self.fp16_groups.append(fp16)
            self.fp32_groups.append(fp32)
            group["params"] = fp32
        first = next((p for g in self.fp16_groups for p in g), None)
        self.overflow_buf = torch.zeros(1, dtype=torch.int32, device=first.device if first is not None else "cpu")
        self.multi_tensor_l2norm = multi_tensor_l2norm
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.cur_iter = 0
        if self.dynamic_loss_scale:
            self.cur_scale = float(args["init_scale"])
            self.last_overflow_iter = -1
            self.scale_factor = float(args["scale_factor"])
            self.scale_window = int(args["scale_window"])
        else:
            self.cur_scale = float(static_loss_scale)
        self.verbose = bool(verbose)

    def zero_grad(self, set_grads_to_None: bool = True) -> None:
        """Clear the fp16 parameters' gradients (to None by default; the masters never have any)."""
        for group in self.fp16_groups:
            for p in group:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss.float() * cur_scale).backward()``: scaled gradients land in the fp16 parameters' ``.grad``."""
        (loss.float() * self.cur_scale).backward()

    @torch.no_grad()
    def step(self, closure=None):
        """Skip (and lower a dynamic scale) on an inf/NaN gradient; otherwise step the wrapped optimizer on
        the fp16 gradients and write the new weights into the fp16 parameters. ``closure`` is not supported,
        as upstream."""
        if closure is not None:
            raise NotImplementedError("FP16_Optimizer.step does not support a closure")
        fp16_grads, norm_groups = [], []
        self.overflow_buf.zero_()
        for group in self.fp16_groups:
            grads = [p.grad for p in group]
            fp16_grads.append(grads)
            present = [g for g in grads if g is not None]
            if present:
                norm, _ = self.multi_tensor_l2norm(_CHUNK, self.overflow_buf, [present], True)
                norm_groups.append(norm)
            else:
                norm_groups.append(torch.zeros(1, device=self.overflow_buf.device))
        if self.overflow_buf.item() != 0:
            self._update_scale(True)
            return None
        self.optimizer.step(grads=fp16_grads, output_params=self.fp16_groups, scale=self.cur_scale,
                            grad_norms=norm_groups)
        self._update_scale(False)
        return None

    def _update_scale(self, skip: bool) -> None:
        if self.dynamic_loss_scale:
            if skip:
                if self.verbose:
                    print("\nGrad overflow on iteration", self.cur_iter)
                    print("Using dynamic loss scale of", self.cur_scale)
                self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
                self.last_overflow_iter = self.cur_iter
            elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
        elif skip and self.verbose:
            print("\nGrad overflow on iteration", self.cur_iter)
            print("Using static loss scale of", self.cur_scale)
        self.cur_iter += 1

    # ``state`` and ``param_groups`` are the wrapped optimizer's (e.g. to change the learning rate)
    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    def state_dict(self) -> dict:
        """The loss-scaling state, the wrapped optimizer's ``state_dict()`` and the fp32 masters."""
        out = {"dynamic_loss_scale": self.dynamic_loss_scale, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter}
        if self.dynamic_loss_scale:
            out.update(last_overflow_iter=self.last_overflow_iter, scale_factor=self.scale_factor,
                       scale_window=self.scale_window)
        out["optimizer_state_dict"] = self.optimizer.state_dict()
        out["fp32_groups"] = self.fp32_groups
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a ``state_dict()``; the fp32 masters are copied from it (not re-derived from the fp16
        weights, which would lose precision)."""
        saved = state_dict["fp32_groups"]
        if [len(g) for g in saved] != [len(g) for g in self.fp32_groups] or any(
                a.shape != b.shape for ga, gb in zip(saved, self.fp32_groups) for a, b in zip(ga, gb)):
            raise ValueError("state_dict['fp32_groups'] does not match this optimizer's parameters")
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.cur_scale = state_dict["cur_scale"]
        self.cur_iter = state_dict["cur_iter"]
        if self.dynamic_loss_scale:
            self.last_overflow_iter = state_dict["last_overflow_iter"]
            self.scale_factor = state_dict["scale_factor"]
            self.scale_window = state_dict["scale_window"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        for current, saved_group in zip(self.fp32_groups, saved):
            for c, s in zip(current, saved_group):
                c.copy_(s)
