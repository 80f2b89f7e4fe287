"""Give an optimizer what ``amp`` needs: gradient unscaling around backward, a skippable ``step``, and
(O2) fp32 master copies of the half parameters.

With master weights, every half parameter in ``param_groups`` is replaced by an fp32 copy: the optimizer
(any ``torch.optim.Optimizer`` or ``apex.optimizers`` optimizer) only ever sees fp32 tensors and keeps its
state in fp32. After each ``step`` the masters are written back to the half model parameters. The masters
are created when ``amp.initialize`` runs, so an ``optimizer.load_state_dict`` right after ``initialize``
lands on them without passing through the half type; they start from the fp32 values the parameters had
before ``initialize`` cast the model (a checkpoint loaded into the fp32 model resumes bit for bit). Masters
made later by ``add_param_group`` start from the half values: the fp32 ones are no longer kept.
"""

from __future__ import annotations

import contextlib
import types
from itertools import repeat
from operator import attrgetter, is_not

import torch

from apex.amp._amp_state import maybe_print
from apex.fp16_utils._scaling import copy_masters_to_model
from apex.fp16_utils.fp16util import _masters_for_group

_grad = attrgetter("grad")

HALF_DTYPES = (torch.float16, torch.bfloat16)


class AmpOptimizerState:
    pass


def _master_params_to_model_params(self) -> None:
    stash = self._amp_stash
    copy_masters_to_model(stash.dummy_overflow_buf, stash.all_fp32_from_fp16_params, stash.all_fp16_params)


def _stash_master_group(stash, half: list, fp32: list, masters: list) -> None:
    """Record one param group in the stash: its half parameters with their fp32 masters, its fp32 ones."""
    for param, master in zip(half, masters):
        stash.model_to_master[id(param)] = (param, master)
    stash.fp16_groups.append(half)
    stash.fp32_from_fp16_groups.append(masters)
    stash.fp32_from_fp32_groups.append(fp32)
    stash.all_fp16_params += half
    stash.all_fp32_from_fp16_params += masters
    stash.all_fp32_from_fp32_params += fp32
    stash.all_fp16_grad_stash += [None] * len(half)
    stash.all_fp32_from_fp32_grad_stash += [None] * len(fp32)


def _split_by_dtype(params: list) -> tuple[list, list]:
    """``(half, fp32)`` parameters; any other dtype is a TypeError."""
    half, fp32 = [], []
    for param in params:
        if param.dtype in HALF_DTYPES:
            half.append(param)
        elif param.dtype == torch.float32:
            fp32.append(param)
        else:
            raise TypeError("Optimizer's parameters must be float32, float16 or bfloat16 tensors. "
                            f"Received {param.type()}")
    return half, fp32


def _stash_plain_params(stash, half: list, fp32: list) -> None:
    """Record parameters (without master weights) whose gradients amp unscales."""
    stash.all_fp16_params += half
    stash.all_fp32_params += fp32
    stash.all_fp16_grad_stash += [None] * len(half)
    stash.all_fp32_grad_stash += [None] * len(fp32)


def _exact_masters(stash) -> None:
    """Give each master the fp32 value its half parameter had before ``amp.initialize`` cast it, where
    the parameter still holds that value's rounding (it was not changed since)."""
    fp32_values = stash.fp32_values or {}
    with torch.no_grad():
        for half, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
            entry = fp32_values.get(id(half))
            if entry is None or entry[0] is not half or entry[1].shape != half.shape:
                continue
            value = entry[1]
            if torch.equal(value.to(half.dtype), half.detach()):
                master.copy_(value)


def lazy_init_with_master_weights(self) -> None:
    stash = self._amp_stash
    stash.fp16_groups, stash.fp32_from_fp16_groups, stash.fp32_from_fp32_groups = [], [], []
    stash.all_fp16_params, stash.all_fp32_from_fp16_params, stash.all_fp32_from_fp32_params = [], [], []
    stash.all_fp16_grad_stash, stash.all_fp32_from_fp32_grad_stash = [], []
    stash.model_to_master = {}
    for param_group in self.param_groups:
        _stash_master_group(stash, *_masters_for_group(param_group, self.state, "Optimizer's parameters"))
    _exact_masters(stash)
    for param in stash.all_fp32_from_fp16_params:
        param.grad = None
    device = next((p.device for p in stash.all_fp16_params), torch.device("cpu"))
    stash.dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
    # Recast any per-parameter state that existed before initialize to the masters' dtype.
    self.load_state_dict(self.state_dict())


def post_backward_models_are_masters(scaler, params, stashed_grads, scale_override=None) -> None:
    """Unscale the fresh grads of ``params`` in place, adding the stashed ones. ``scale_override``:
    ``(grads_have_scale, stashed_have_scale, out_scale)``, the sums then kept at ``out_scale``."""
    if not any(map(is_not, stashed_grads, repeat(None))):  # nothing accumulated (the usual step): no loop
        grads = list(map(_grad, params))
        if not all(map(is_not, grads, repeat(None))):
            grads = [g for g in grads if g is not None]
        if grads:
            scaler.unscale(grads, grads, scaler.loss_scale(), models_are_masters=True,
                           scale_override=None if scale_override is None else scale_override[0] / scale_override[2])
        return
    grads_needing_unscale, grads_with_stash, stashed = [], [], []
    for i, (param, stashed_grad) in enumerate(zip(params, stashed_grads)):
        if param.grad is None and stashed_grad is not None:
            param.grad = stashed_grad
        elif param.grad is not None and stashed_grad is None:
            grads_needing_unscale.append(param.grad)
        elif param.grad is not None and stashed_grad is not None:
            grads_with_stash.append(param.grad)
            stashed.append(stashed_grad)
        stashed_grads[i] = None
    if grads_needing_unscale:
        scaler.unscale(grads_needing_unscale, grads_needing_unscale, scaler.loss_scale(),
                       models_are_masters=True,
                       scale_override=None if scale_override is None else scale_override[0] / scale_override[2])
    if grads_with_stash:
        scaler.unscale_with_stashed(grads_with_stash, stashed, grads_with_stash, scale_override=scale_override)


def _keeps_model_grads(optimizer) -> bool:
    """``FusedSGD(materialize_master_grads=False)`` (Apex's protocol): the optimizer reads the half model
    grads, still scaled, and divides by its ``most_recent_scale`` inside the update; amp makes no fp32
    master grads for it."""
    from apex.optimizers.fused_sgd import FusedSGD  # (FusedLARS has the flag but reads the master grads)

    return isinstance(optimizer, FusedSGD) and optimizer.materialize_master_grads is False


def _model_grad_lists(stash):
    return ((stash.all_fp16_params, stash.all_fp16_grad_stash),
            (stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash))


def _prepare_backward_keep_model_grads(self) -> None:
    for params, grad_stash in _model_grad_lists(self._amp_stash):
        for i, param in enumerate(params):
            grad_stash[i] = param.grad
            param.grad = None


def _post_backward_keep_model_grads(self, scaler) -> None:
    # The grads already accumulated carry the optimizer's most_recent_scale, the new ones this loss's scale:
    # the sums are kept at the smaller of the two (no overflow from rescaling up), which the step divides out.
    grads_have = scaler.loss_scale()
    stashed_have = self.most_recent_scale
    out = min(grads_have, stashed_have) if self.scale_set_by_backward else grads_have
    for params, grad_stash in _model_grad_lists(self._amp_stash):
        post_backward_models_are_masters(scaler, params, grad_stash, (grads_have, stashed_have, out))
    self.most_recent_scale = out
    self.scale_set_by_backward = True


def prepare_backward_with_master_weights(self) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    if _keeps_model_grads(self):
        return _prepare_backward_keep_model_grads(self)
    for param in stash.all_fp16_params:
        param.grad = None  # the backward writes fresh half grads; the fp32 masters keep what came before
    for i, param in enumerate(stash.all_fp32_from_fp32_params):
        stash.all_fp32_from_fp32_grad_stash[i] = param.grad
        param.grad = None


def post_backward_with_master_weights(self, scaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    if _keeps_model_grads(self):
        return _post_backward_keep_model_grads(self, scaler)
    new_in, new_out, acc_in, acc_out = [], [], [], []
    for half, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        if half.grad is None:
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
            new_in.append(half.grad)
            new_out.append(master.grad)
        else:
            acc_in.append(half.grad)
            acc_out.append(master.grad)
    if new_in:
        scaler.unscale(new_in, new_out, scaler.loss_scale(), models_are_masters=False)
    if acc_in:
        scaler.unscale_with_stashed(acc_in, acc_out, acc_out)
    post_backward_models_are_masters(scaler, stash.all_fp32_from_fp32_params,
                                     stash.all_fp32_from_fp32_grad_stash)


def lazy_init_no_master_weights(self) -> None:
    stash = self._amp_stash
    stash.all_fp16_params, stash.all_fp32_params = [], []
    stash.all_fp16_grad_stash, stash.all_fp32_grad_stash = [], []
    for param_group in self.param_groups:
        _stash_plain_params(stash, *_split_by_dtype(param_group["params"]))


def prepare_backward_no_master_weights(self) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    for params, grad_stash in ((stash.all_fp16_params, stash.all_fp16_grad_stash),
                               (stash.all_fp32_params, stash.all_fp32_grad_stash)):
        grad_stash[:] = map(_grad, params)
        if any(map(is_not, grad_stash, repeat(None))):  # (after zero_grad(set_to_none=True): none to clear)
            for param in params:
                param.grad = None


def post_backward_no_master_weights(self, scaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    for params, grad_stash in ((stash.all_fp16_params, stash.all_fp16_grad_stash),
                               (stash.all_fp32_params, stash.all_fp32_grad_stash)):
        post_backward_models_are_masters(scaler, params, grad_stash)


def _amp_lazy_init(self) -> None:
    stash = self._amp_stash
    if not stash.lazy_init_called:
        self._lazy_init_maybe_master_weights()
        stash.lazy_init_called = True


def _skip_step(self, closure) -> None:
    stash = self._amp_stash
    if closure is not None:
        raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
    loss_id, scaler = stash.skip_pending
    maybe_print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
                f"{scaler.loss_scale()}")
    # Master grads are not cleared by model.zero_grad(); drop them so the next step starts clean.
    for param in getattr(stash, "all_fp32_from_fp16_params", ()):
        param.grad = None
    if hasattr(self, "most_recent_scale"):
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
    stash.skip_pending = None
    stash.already_patched = False


def _add_param_group_after(old_add_param_group):
    """Apex's ``add_param_group`` after ``amp.initialize``: the new group's half parameters get fp32
    masters (with master weights) and every new parameter's gradients are unscaled like the others'."""

    def add_param_group(self, new_group: dict) -> None:
        stash = self._amp_stash
        self._amp_lazy_init()
        if not isinstance(new_group, dict):
            raise TypeError(f"param group must be a dict, got {type(new_group).__name__}")
        params = new_group["params"]
        if isinstance(params, torch.Tensor):
            new_group["params"] = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                            "ordering of tensors in sets will change between runs. Please use a list instead.")
        else:
            new_group["params"] = list(params)
        # Every check before anything changes (a half parameter's place in the groups is taken by its
        # master, so torch's own duplicate check would not see it).
        half, fp32 = _split_by_dtype(new_group["params"])
        known = {id(p) for g in self.param_groups for p in g["params"]}
        known.update(id(p) for p in stash.all_fp16_params)
        if any(id(p) in known for p in new_group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        if stash.master_weights:
            half, fp32, masters = _masters_for_group(new_group, self.state, "Optimizer's parameters")
        old_add_param_group(new_group)  # (its remaining checks run before the stash learns of the group)
        if stash.master_weights:
            _stash_master_group(stash, half, fp32, masters)
        else:
            _stash_plain_params(stash, half, fp32)

    return add_param_group


def _process_optimizer(optimizer, properties, casts_disabled=contextlib.nullcontext, fp32_values=None):
    """Attach amp's stash and methods to ``optimizer`` (in place) and return it. ``fp32_values``: ``{id(param):
    (param, fp32 value before the model was cast)}``, the exact starting values of the masters."""
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    for name in ("_lazy_init_maybe_master_weights", "_master_params_to_model_params",
                 "_prepare_amp_backward", "_post_amp_backward", "_amp_lazy_init"):
        if hasattr(optimizer, name):
            raise RuntimeError(f"Incoming optimizer already has {name} defined.")
    stash = optimizer._amp_stash = AmpOptimizerState()
    stash.lazy_init_called = False
    stash.already_patched = False
    stash.params_have_scaled_gradients = False
    stash.skip_pending = None
    stash.master_weights = bool(properties.master_weights)
    bind = lambda fn: types.MethodType(fn, optimizer)
    if properties.master_weights:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_with_master_weights)
        optimizer._master_params_to_model_params = bind(_master_params_to_model_params)
        optimizer._prepare_amp_backward = bind(prepare_backward_with_master_weights)
        optimizer._post_amp_backward = bind(post_backward_with_master_weights)
    else:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_no_master_weights)
        optimizer._prepare_amp_backward = bind(prepare_backward_no_master_weights)
        optimizer._post_amp_backward = bind(post_backward_no_master_weights)
    optimizer._amp_lazy_init = bind(_amp_lazy_init)
    stash.fp32_values = fp32_values
    optimizer._amp_lazy_init()
    stash.fp32_values = None  # only the masters made now start from them; let the old storage go

    old_step = optimizer.step

    def new_step(self, closure=None, *args, **kwargs):
        if self._amp_stash.skip_pending is not None:
            return _skip_step(self, closure)
        with casts_disabled():
            retval = old_step(closure, *args, **kwargs) if (closure is not None or args or kwargs) \
                else old_step()
        if self._amp_stash.master_weights:
            self._master_params_to_model_params()
            for param in self._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
        return retval

    optimizer.step = bind(new_step)
    optimizer.add_param_group = bind(_add_param_group_after(optimizer.add_param_group))

    if properties.master_weights:
        def new_zero_grad(self, set_to_none: bool = True):
            stash = self._amp_stash
            self._amp_lazy_init()
            for param in stash.all_fp16_params + stash.all_fp32_from_fp32_params:
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_()
                    param.grad.zero_()
            for param in stash.all_fp32_from_fp16_params:
                param.grad = None

        optimizer.zero_grad = bind(new_zero_grad)
    return optimizer
