"""The step of :class:`~apex.contrib.optimizers.distributed_fused_lamb.DistributedFusedLAMB` on this rank's shard
(see that module's docstring for the math): the overflow check on the reduced gradients' norm, the unscaling and
clipping, FusedLAMB's update direction on the shard's fragments, and the trust ratios of whole parameters.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from apex.contrib.optimizers._gloo_collectives import all_reduce as _all_reduce
from apex.ops.multi_tensor_adam import multi_tensor_adam
from apex.ops.multi_tensor_l2norm import multi_tensor_l2norm
from apex.ops.multi_tensor_lamb import multi_tensor_lamb, multi_tensor_lamb_stage2_cuda
from apex.optimizers._base import _number, fused_step

_CHUNK = 2048 * 32


class _Step:
    """``DistributedFusedLAMB``'s ``step`` (a base class of it; the methods read and set its attributes)."""

    def _scale_value(self) -> float:
        s = self._global_scale
        return 1.0 if s is None else _number(s, "global_scale")

    @fused_step  # (no_grad; torch.optim's hooks and profiler range only while there is one: see _zero_step)
    def step(self, closure=None, grad_scaler=None):
        """One LAMB step (see the module docstring); ``grad_scaler``: a ``torch.amp.GradScaler`` whose scale is
        used when ``set_global_scale`` was not called and which is told whether the step overflowed."""
        if self._is_accumulation_step:
            raise RuntimeError("step() called during an accumulation step; call set_is_accumulation_step(False) "
                               "before the last backward of the step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.complete_reductions()
        if self._global_scale is None and grad_scaler is not None:
            scale = _number(grad_scaler._get_scale_async(), "grad_scaler's scale")
        else:
            scale = self._scale_value()
        norm = self._L2_grad_norm
        if self._clip_after_ar:
            # every rank holds the same norm: its one host read also tells whether it is finite (no
            # isfinite / cast / item ops, and one device sync a step instead of two)
            norm_value = float(norm)
            self._has_overflow = not math.isfinite(norm_value)
        else:  # local norms differ: skip everywhere if any rank overflowed
            finite = torch.isfinite(norm).to(torch.int32)
            _all_reduce(finite, op=dist.ReduceOp.MIN)
            self._has_overflow = not bool(finite.item())
            norm_value = None if self._has_overflow else float(norm)
        self._overflow_buf.fill_(int(self._has_overflow))
        if grad_scaler is not None:
            state = grad_scaler._per_optimizer_states[id(self)]
            state["found_inf_per_device"][self._device] = torch.full(
                (1,), float(self._has_overflow), device=self._device)
        if not self._has_overflow:
            self._step += 1
            self._update(scale, norm_value)
            self._gather_params()
        self._reset_step_state()
        return loss

    def _update(self, scale: float, norm: float) -> None:
        max_norm = self.defaults["max_grad_norm"] if self._clip_after_ar else 0.0
        clip = 1.0
        if max_norm > 0 and norm / scale > max_norm:
            clip = norm / scale / max_norm
        torch.div(self._fp16_g, scale * clip, out=self._fp32_g)
        self._fp32_u.zero_()
        zero_norm = self._zero_norm
        for group, (_, (g, _p, m, v, u)), ws, (g_runs, p_runs, u_runs) in zip(
                self.param_groups, self._group_frags, self._lamb_workspaces, self._group_runs):
            if not g:
                continue
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            if not self._adam_w_mode and wd != 0:
                torch._foreach_add_(g_runs, p_runs, alpha=wd)
            # FusedLAMB's update direction, without decay or trust ratio, written into the zeroed u:
            # u = 0 - (-1) * m̂ / (sqrt(v̂) + eps). With grad averaging (m += (1 - beta1) g) that is Adam's
            # moment update and direction, which apex.ops.multi_tensor_adam computes in one fused pass
            # (measured on 0.4 M elements: 0.32 ms against 0.60 ms through the LAMB kernel).
            if group["grad_averaging"]:
                multi_tensor_adam(_CHUNK, self._overflow_buf, [g, u, m, v], -1.0, beta1, beta2, group["eps"],
                                  self._step, 1, 1 if group["bias_correction"] else 0, 0.0, validate=False)
            else:
                multi_tensor_lamb(_CHUNK, self._overflow_buf, [g, u, m, v], -1.0, beta1, beta2, group["eps"],
                                  self._step, 1 if group["bias_correction"] else 0, 0.0, 0, 1, zero_norm, 1.0,
                                  False, validate=False, workspace=ws)
            if self._adam_w_mode and wd != 0:
                torch._foreach_add_(u_runs, p_runs, alpha=wd)
        # trust ratios of whole parameters: the fragments' squared norms summed over the shards
        sq = self._norm_sq.zero_()  # (norms[idx] below are copies: the buffer is free again next step)
        if self._frags_pu:  # the fragments of p, then of u
            per = multi_tensor_l2norm(_CHUNK, self._overflow_buf, [self._frags_pu], True, validate=False)[1]
            sq.index_add_(0, self._norm_index, per.float().square())
        _all_reduce(sq, group=self._rs_pg)
        norms = sq.sqrt_()
        for group, (idx, (_, p, _, _, u)), u_idx in zip(self.param_groups, self._group_frags, self._group_u_index):
            if not p:
                continue
            lr = group["lr"] if self._lr is None else _number(self._lr, "_lr")
            multi_tensor_lamb_stage2_cuda(_CHUNK, self._overflow_buf, [p, u], norms[idx], norms[u_idx], lr,
                                          group["weight_decay"], self._use_nvlamb, validate=False)
