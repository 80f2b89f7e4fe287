"""The work behind ``amp.initialize``: checks, model casting, forward patching, optimizer processing."""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from collections.abc import Mapping

import torch

from apex.amp._amp_state import _amp_state, warn_or_err
from apex.amp._process_optimizer import HALF_DTYPES, _process_optimizer
from apex.amp.scaler import LossScaler
from apex.fp16_utils.fp16util import convert_network


def to_type(dtype, t):
    if isinstance(t, torch.Tensor):
        return t.to(dtype) if t.is_floating_point() else t
    return t.to(dtype)


def applier(value, fn):
    """Apply ``fn`` to every tensor (or object with ``.to``) inside nested containers."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (str, bytes)):
        return value
    if type(value).__module__ == "numpy":
        return value
    if hasattr(value, "to"):
        return fn(value)
    if isinstance(value, Mapping):
        items = [(applier(k, fn), applier(v, fn)) for k, v in value.items()]
        try:
            return type(value)(items)
        except TypeError:
            return dict(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(applier(v, fn) for v in value))
    if isinstance(value, (list, tuple, set)):
        return type(value)(applier(v, fn) for v in value)
    return value


def _parallel_type(model) -> str | None:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "torch.nn.parallel.DistributedDataParallel"
    if isinstance(model, torch.nn.parallel.DataParallel):
        return "torch.nn.parallel.DataParallel"
    for cls in type(model).__mro__:
        if cls.__name__ == "DistributedDataParallel":
            return f"{cls.__module__}.DistributedDataParallel".replace("apex.parallel.distributed",
                                                                        "apex.parallel")
    return None


def check_models(models) -> None:
    for model in models:
        parallel_type = _parallel_type(model)
        if parallel_type is not None:
            raise RuntimeError(f"Incoming model is an instance of {parallel_type}. "
                               "Parallel wrappers should only be applied to the model(s) AFTER \n"
                               "the model(s) have been returned from amp.initialize.")


def check_params_fp32(models) -> None:
    for model in models:
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                if t.is_floating_point() and t.dtype in HALF_DTYPES:
                    warn_or_err(f"Found {kind} {name} with type {t.type()}, expected torch.float32.\n"
                                "When using amp.initialize, you do not need to call .half() on your model\n"
                                "before passing it, no matter what optimization level you choose.")


def check_optimizers(optimizers) -> None:
    for optim in optimizers:
        bad = None
        name = type(optim).__name__
        if name == "FP16_Optimizer":
            bad = f"{type(optim).__module__.rsplit('.', 1)[0]}.FP16_Optimizer"
        if bad is not None:
            raise RuntimeError(f"An incoming optimizer is an instance of {bad}. "
                               "The optimizer(s) passed to amp.initialize() must be bare \n"
                               "instances of either ordinary Pytorch optimizers, or Apex fused \n"
                               "optimizers. \n"
                               "You should not manually wrap your optimizer in either \n"
                               "apex.fp16_utils.FP16_Optimizer or apex.optimizers.FP16_Optimizer. \n"
                               "amp.initialize will take care of that for you (if necessary) based \n"
                               "on the specified opt_level (and optional overridden properties).")


def _is_optimizer(o) -> bool:
    return isinstance(o, torch.optim.Optimizer) or type(o).__name__ == "LARC"


def _models_device_type(models) -> str:
    mods = [models] if isinstance(models, torch.nn.Module) else models if isinstance(models, list) else []
    for m in mods:
        if isinstance(m, torch.nn.Module):
            for t in list(m.parameters()) + list(m.buffers()):
                return t.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _patch_forward(model, input_caster, output_caster) -> None:
    old_fwd = model.forward

    @functools.wraps(old_fwd)
    def new_fwd(*args, **kwargs):
        if input_caster is not None:
            args, kwargs = applier(args, input_caster), applier(kwargs, input_caster)
        return applier(old_fwd(*args, **kwargs), output_caster)

    model.forward = new_fwd


def _install_master_state_hooks(model, model_to_master) -> None:
    """``model.state_dict()`` gives fp32 values (the masters); ``load_state_dict`` refreshes the masters."""

    def save_hook(module, state_dict, prefix, local_metadata):
        for name, p in module.named_parameters():
            key = prefix + name
            if key not in state_dict:
                continue
            entry = model_to_master.get(id(p))
            if entry is not None and entry[0] is p:
                state_dict[key] = entry[1].detach()
            elif state_dict[key].dtype in HALF_DTYPES:
                state_dict[key] = state_dict[key].float()
        for name, b in module.named_buffers():
            key = prefix + name
            if key in state_dict and b.dtype in HALF_DTYPES:
                state_dict[key] = state_dict[key].float()

    def load_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        with torch.no_grad():
            for name, p in module.named_parameters():
                entry = model_to_master.get(id(p))
                value = state_dict.get(prefix + name)
                if entry is None or entry[0] is not p or not isinstance(value, torch.Tensor):
                    continue
                if value.shape == entry[1].shape:
                    entry[1].copy_(value)

    model.register_state_dict_post_hook(save_hook)
    model.register_load_state_dict_pre_hook(load_hook)


def _initialize(models, optimizers, properties, num_losses: int = 1, cast_model_outputs=None):
    from apex.amp import amp as amp_mod

    optimizers_was_list = False
    if _is_optimizer(optimizers):
        optimizers = [optimizers]
    elif optimizers is None:
        optimizers = []
    elif isinstance(optimizers, list):
        optimizers_was_list = True
        check_optimizers(optimizers)
        for o in optimizers:
            if not _is_optimizer(o):
                raise TypeError(f"optimizers must be an optimizer or a list of optimizers; found a "
                                f"{type(o).__name__} in the list")
    else:
        check_optimizers([optimizers])
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")

    if isinstance(models, torch.nn.Module):
        models_was_list = False
        models = [models]
    elif isinstance(models, list):
        models_was_list = True
        for m in models:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"models must be a torch.nn.Module or a list of them; found a "
                                f"{type(m).__name__} in the list")
    else:
        raise TypeError("models must be either a single model or a list of models.")

    check_models(models)
    if not _amp_state.allow_incoming_model_not_fp32:
        check_params_fp32(models)

    # Every check that can fail runs before anything is modified.
    seen: set = set()
    for opt in optimizers:
        if hasattr(opt, "_amp_stash") or id(opt) in seen:
            raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
        seen.add(id(opt))

    fp32_values = None
    if properties.cast_model_type and properties.master_weights:
        # The fp32 values as they were before the cast, for O2's masters: a master rebuilt from the half
        # copy would lose the low bits of a checkpoint loaded into the fp32 model before initialize.
        # (References, not copies: the cast gives each parameter new storage.)
        fp32_values = {id(p): (p, p.detach()) for model in models for p in model.parameters()
                       if p.dtype == torch.float32}
    if properties.cast_model_type:
        for model in models:
            if properties.keep_batchnorm_fp32:
                convert_network(model, properties.cast_model_type)
            else:
                model.to(properties.cast_model_type)
        input_caster = functools.partial(to_type, properties.cast_model_type)
        output_caster = functools.partial(to_type, cast_model_outputs if cast_model_outputs is not None
                                          else torch.float32)
        for model in models:
            _patch_forward(model, input_caster, output_caster)
        # Recast any pre-existing per-parameter state tensors.
        for optimizer in optimizers:
            optimizer.load_state_dict(optimizer.state_dict())
    elif cast_model_outputs is not None:
        output_caster = functools.partial(to_type, cast_model_outputs)
        for model in models:
            _patch_forward(model, None, output_caster)

    casts_disabled = _StepCastsDisabled() if properties.patch_torch_functions else None
    for i, optimizer in enumerate(optimizers):
        kw = {"casts_disabled": casts_disabled} if casts_disabled is not None else {}
        optimizers[i] = _process_optimizer(optimizer, properties, fp32_values=fp32_values, **kw)
    fp32_values = None

    if properties.master_weights or properties.cast_model_type:
        # model.state_dict() is fp32 whenever the model was cast (Apex's O2StateDictHook): the masters'
        # values where there are masters, the half values widened otherwise.
        # A live view: masters made later by add_param_group are seen too.
        model_to_master = collections.ChainMap(*[optimizer._amp_stash.model_to_master for optimizer in optimizers
                                                 if hasattr(optimizer._amp_stash, "model_to_master")])
        for model in models:
            _install_master_state_hooks(model, model_to_master)

    device = None
    for model in models:
        for t in list(model.parameters()) + list(model.buffers()):
            device = t.device
            break
        if device is not None:
            break
    # A dynamic scale starts at 2**16, or at max_loss_scale when that is lower, as in Apex.
    max_scale = _amp_state.max_loss_scale
    init_scale = 2.0 ** 16 if max_scale is None else min(2.0 ** 16, float(max_scale))
    _amp_state.loss_scalers = [
        LossScaler(properties.loss_scale, init_scale=init_scale, min_loss_scale=_amp_state.min_loss_scale,
                   max_loss_scale=_amp_state.max_loss_scale, device=device)
        for _ in range(num_losses)
    ]

    if properties.patch_torch_functions:
        handle = amp_mod.init(loss_scale=properties.loss_scale, verbose=(_amp_state.verbosity == 2),
                              device_type=_amp_state.device_type, dtype=_amp_state.half_dtype)
        _switch_off_with_models(handle, models)

    if optimizers_was_list:
        return (models if models_was_list else models[0]), optimizers
    if len(optimizers) == 0:
        return models if models_was_list else models[0]
    return (models if models_was_list else models[0]), optimizers[0]


def _switch_off_with_models(handle, models) -> None:
    """O1's casting is process-wide, like Apex's; unlike Apex it ends when the last model it was set up
    for is garbage-collected, so code that runs afterwards is not silently cast."""
    thread = threading.get_ident()
    alive = [len(models)]

    def gone() -> None:
        alive[0] -= 1
        # Autocast state is per thread: only the thread that switched it on may switch it off.
        if alive[0] == 0 and threading.get_ident() == thread:
            handle._deactivate()

    for model in models:
        weakref.finalize(model, gone)


class _StepCastsDisabled:
    """Context factory: the optimizer step runs outside O1's casting."""

    def __call__(self):
        from apex.amp.handle import disable_casts

        return disable_casts()
