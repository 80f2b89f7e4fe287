"""``FusedAdamSWA``: OpenFold's optimizer step fused with the bf16 copy and the SWA average.

Three parallel lists of parameters: ``params`` (the fp32/fp64 state the optimizer updates),
``compute_params`` (the copies the model runs with, often bf16, which carry the gradients) and
``swa_params`` (the exponential average used for evaluation). One :meth:`FusedAdamSWA.step` does, per
element (see ``apex.ops.openfold_adam_swa`` for the math of each :class:`AdamMathType`): scale the gradient
by ``grad_clip_scale``, an Adam update of ``params``, a copy into ``compute_params``, and the SWA update
``swa = params`` on the first average, else ``swa += (1 − swa_decay_rate)·(params − swa)``.

Dtype policy: arithmetic in fp64 for fp64 state parameters, fp32 otherwise. One Triton launch per dtype
group on GPUs; ``torch._foreach_*`` operators on CPUs. Differences from upstream: parameters whose compute
copy has no gradient are skipped by Adam (upstream mis-indexes them) but still averaged;
:meth:`zero_grad` clears the compute parameters' gradients, where the gradients live.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from enum import Enum, unique
from itertools import chain

import torch
import torch.nn as nn
from torch.optim import Adam, Optimizer

from apex._errors import AssertValueError
from apex.ops.openfold_adam_swa import adam_swa_step


@unique
class AdamMathType(Enum):
    """Adam variants: Apex's Adam (L2), Apex's AdamW (decoupled decay) and ``torch.optim.Adam``'s order."""

    ApexAdam = 0
    ApexAdamW = 1
    PyTorchAdam = 2


class FusedAdamSWA(Optimizer):
    def __init__(
        self,
        params: Iterable[nn.Parameter],
        compute_params: Iterable[nn.Parameter],
        swa_params: Iterable[nn.Parameter],
        swa_decay_rate: float,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_math_mode: AdamMathType = AdamMathType.PyTorchAdam,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ):
        params, compute_params, swa_params = list(params), list(compute_params), list(swa_params)
        if not compute_params or not swa_params:
            raise ValueError("FusedAdamSWA requires both compute (bf16) and SWA parameters")
        if not len(params) == len(compute_params) == len(swa_params):
            raise ValueError(f"FusedAdamSWA expects params, compute_params and swa_params of equal lengths, got "
                             f"{len(params)}, {len(compute_params)}, {len(swa_params)}")
        for i, (p, c, s) in enumerate(zip(params, compute_params, swa_params)):
            if not p.shape == c.shape == s.shape:
                raise ValueError(f"parameter {i}: params, compute_params and swa_params shapes differ "
                                 f"({list(p.shape)}, {list(c.shape)}, {list(s.shape)})")
            if p.dtype != s.dtype:
                raise ValueError(f"parameter {i}: params ({p.dtype}) and swa_params ({s.dtype}) must share a dtype")
            if not (p.device == c.device == s.device):
                raise ValueError(f"parameter {i}: params, compute_params and swa_params must share a device")
        if not all(t.is_contiguous() for t in chain(params, compute_params, swa_params)):
            raise ValueError("FusedAdamSWA expects all input params to be contiguous")
        if amsgrad:
            raise NotImplementedError("amsgrad is not supported by FusedAdamSWA")
        if capturable:
            raise NotImplementedError("capturable is not supported by FusedAdamSWA")
        if master_weights:
            raise NotImplementedError("master_weights is not supported by FusedAdamSWA")
        if not isinstance(adam_math_mode, AdamMathType):
            raise ValueError(f"adam_math_mode must be an AdamMathType ({[m.name for m in AdamMathType]}), "
                             f"got {adam_math_mode!r}")
        if not 0.0 <= lr:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not 0.0 <= swa_decay_rate <= 1.0:
            raise ValueError(f"swa_decay_rate must be in [0, 1], got {swa_decay_rate}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_math_mode = adam_math_mode
        self.set_grad_none = set_grad_none
        self.compute_param_groups = [{"params": compute_params}]
        self.swa_param_groups = [{"params": swa_params, "n_averaged": 0}]
        self.swa_decay_rate = swa_decay_rate

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients of the compute parameters (and of the state parameters, if any)."""
        none = self.set_grad_none if set_to_none is None else set_to_none
        for p in chain(self.compute_param_groups[0]["params"], self.param_groups[0]["params"]):
            if p.grad is None:
                continue
            if none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def _states(self, params):
        moments, velocities = [], []
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state or "exp_avg_sq" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
            moments.append(state["exp_avg"])
            velocities.append(state["exp_avg_sq"])
        return moments, velocities

    def step(self, closure: Callable[[], torch.Tensor] | None = None,
             grad_clip_scale: torch.Tensor | float | None = None):
        if not all(len(g) == 1 for g in (self.param_groups, self.compute_param_groups, self.swa_param_groups)):
            raise RuntimeError("FusedAdamSWA does not support multiple param groups")
        group = self.param_groups[0]
        params = group["params"]
        compute = self.compute_param_groups[0]["params"]
        swa_group = self.swa_param_groups[0]
        swa = swa_group["params"]
        with_grad = [i for i, c in enumerate(compute) if c.grad is not None]
        for i in with_grad:
            if compute[i].grad.is_sparse:
                raise RuntimeError("FusedAdamSWA does not support sparse gradients, please consider SparseAdam "
                                   "instead")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            with_grad = [i for i, c in enumerate(compute) if c.grad is not None]
        step = int(group.get("step", 0)) + 1  # recorded only once the update went through
        beta1, beta2 = group["betas"]
        bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if group["bias_correction"] else (1.0, 1.0)
        first = int(swa_group["n_averaged"]) == 0
        sel = [params[i] for i in with_grad]
        moments, velocities = self._states(sel)
        with torch.no_grad():
            adam_swa_step([compute[i].grad for i in with_grad], sel, [compute[i] for i in with_grad],
                          [swa[i] for i in with_grad], moments, velocities, lr=group["lr"], beta1=beta1,
                          beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], bias_correction1=bc1,
                          bias_correction2=bc2, swa_decay_rate=self.swa_decay_rate, first_average=first,
                          mode=self.adam_math_mode.value, grad_scale=grad_clip_scale,
                          step=step if group["bias_correction"] else None)
            rest = [i for i in range(len(params)) if i not in set(with_grad)]
            if rest:  # no gradient: no Adam update, but the average still moves toward the parameters
                if first:
                    torch._foreach_copy_([swa[i] for i in rest], [params[i] for i in rest])
                else:
                    torch._foreach_lerp_([swa[i] for i in rest], [params[i] for i in rest], 1.0 - self.swa_decay_rate)
        group["step"] = step
        swa_group["n_averaged"] += 1
        return loss

    @classmethod
    def from_optim(cls, adam_optimizer: Adam, fp32_params: list[nn.Parameter], bf16_params: list[nn.Parameter],
                   swa_params: list[nn.Parameter], swa_decay_rate: float) -> FusedAdamSWA:
        """A ``FusedAdamSWA`` (PyTorch Adam math) taking over ``adam_optimizer``'s hyperparameters and state."""
        if len(adam_optimizer.param_groups) != 1:  # Apex asserts this
            raise AssertValueError("FusedAdamSWA.from_optim needs an optimizer with exactly one param group")
        pg = adam_optimizer.param_groups[0]
        fused = cls(params=fp32_params, compute_params=bf16_params, swa_params=swa_params,
                    swa_decay_rate=swa_decay_rate, lr=pg["lr"], betas=pg["betas"], eps=pg["eps"],
                    weight_decay=pg["weight_decay"], amsgrad=pg.get("amsgrad", False),
                    adam_math_mode=AdamMathType.PyTorchAdam)
        # A copy: the Adam optimizer's moment tensors must not be updated behind its back.
        sd = copy.deepcopy(adam_optimizer.state_dict())
        sd["param_groups"][0].setdefault("bias_correction", True)
        steps = [v["step"] for v in sd["state"].values() if "step" in v]
        if steps and not all(float(s) == float(steps[0]) for s in steps):
            raise ValueError("FusedAdamSWA requires all parameters to have been updated the same number of steps")
        # A fresh Adam has taken no step yet: the first fused step is step 1.
        sd["param_groups"][0]["step"] = int(float(steps[0])) if steps else 0
        fused.load_state_dict(sd)
        return fused
