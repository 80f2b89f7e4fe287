"""``amp.initialize``, the O0-O3 presets, property overrides, and amp's checkpoint state."""

from __future__ import annotations

from collections import OrderedDict

import torch

from apex.amp._amp_state import _amp_state, default_half_dtype, maybe_print, warn_or_err
from apex.amp._initialize import _initialize, _models_device_type
from apex.amp._slow_half import warn_if_slow

_HALF = (torch.float16, torch.bfloat16)


class Properties:
    """The options of a run. Setting one goes through Apex's consistency checks (``warn_or_err``)."""

    def __init__(self) -> None:
        self.options = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def _update_options_dict(self, new_options) -> None:
        for k, v in new_options:
            if k in self.options:
                self.options[k] = v
            else:
                raise ValueError(f"Tried to set unexpected option {k}")

    def __getattr__(self, name):
        if "options" in self.__dict__:
            options = self.__dict__["options"]
            if name in options:
                return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value) -> None:
        if "options" not in self.__dict__:
            super().__setattr__(name, value)
            return
        if name not in self.options:
            super().__setattr__(name, value)
            return
        if name == "cast_model_type":
            if self.opt_level == "O1" and value not in (None, False, torch.float32):
                warn_or_err("O1 inserts casts around Torch functions rather than "
                            "model weights, so with O1, the model weights themselves "
                            "should remain FP32. If you wish to cast the model to a "
                            "different type, use opt_level='O2' or 'O3'. "
                            f"cast_model_type was {value}")
            self.options[name] = value
        elif name == "patch_torch_functions":
            if self.opt_level != "O1" and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by "
                            "selecting opt_level='O1'.")
            self.options[name] = value
        elif name == "keep_batchnorm_fp32":
            if self.opt_level == "O1" and value is not None:
                warn_or_err("With opt_level O1, batchnorm functions are automatically patched "
                            "to run in FP32, so keep_batchnorm_fp32 should be None."
                            f" keep_batchnorm_fp32 was {value}")
            if value == "False":
                self.options[name] = False
            elif value == "True":
                self.options[name] = True
            else:
                if not (value is True or value is False or value is None):
                    raise ValueError("keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', "
                                     f"or None, found keep_batchnorm_fp32={value}")
                self.options[name] = value
        elif name == "master_weights":
            if self.opt_level == "O1" and value is not None:
                warn_or_err("It doesn't make sense to use master_weights with O1. "
                            "With O1, your model weights themselves should be FP32.")
            self.options[name] = value
        elif name == "loss_scale":
            if value == "dynamic":
                self.options[name] = value
            else:
                try:
                    self.options[name] = float(value)
                except (TypeError, ValueError):
                    raise ValueError("loss_scale must be a number, a string holding a number (e.g. "
                                     f"\"128.0\") or the string \"dynamic\", got {value!r}") from None
        else:
            self.options[name] = value


class _OptLevel:
    """A preset: ``properties`` gets ``enabled``, the level's name, then ``settings`` in order (each through
    the checks of :class:`Properties`)."""

    settings: dict = {}

    def __call__(self, properties):
        properties.enabled = True
        properties.opt_level = type(self).__name__
        for name, value in self.settings.items():
            setattr(properties, name, value)
        return properties


class O3(_OptLevel):
    brief = "O3:  Pure FP16 training."
    more = ("Calls .half() on your model, converting the entire model to FP16.\n"
            "A casting operation is also inserted to cast incoming Tensors to FP16,\n"
            "so you don't need to change your data pipeline.\n"
            "This mode is useful for establishing a performance ceiling.\n"
            "It's also possible training may 'just work' in this mode.\n"
            "If not, try other optimization levels.")

    settings = {"cast_model_type": torch.float16,
                "patch_torch_functions": False,
                "keep_batchnorm_fp32": False,
                "master_weights": False,
                "loss_scale": 1.0}


class O2(_OptLevel):
    brief = "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n"
    more = ("Calls .half() on your model, converting the entire model (except for batchnorms)\n"
            "to FP16.  Batchnorms are retained in FP32 for additional stability.\n"
            "The forward pass is patched to cast incoming Tensors to FP16, so you don't need to change\n"
            "your data pipeline.\n"
            "O2 creates FP32 master weights outside the model and patches any optimizers to update\n"
            "these master weights, then copy the master weights into the FP16 model weights.\n"
            "Master weights can also improve convergence and stability.")

    settings = {"cast_model_type": torch.float16,
                "patch_torch_functions": False,
                "keep_batchnorm_fp32": True,
                "master_weights": True,
                "loss_scale": "dynamic"}


class O1(_OptLevel):
    brief = "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n"
    more = ("The type of your model's weights is not altered.  However, internally,\n"
            "Pytorch functions are patched to cast any Tensor Core-friendly ops to FP16 for speed,\n"
            "while operations that might benefit from the additional stability of FP32 are patched\n"
            "to cast their inputs to fp32.\n"
            "O1 is the safest way to try mixed precision training, and is recommended when\n"
            "trying mixed precision training for the first time.")

    settings = {"cast_model_type": None,
                "patch_torch_functions": True,
                "keep_batchnorm_fp32": None,
                "master_weights": None,
                "loss_scale": "dynamic"}


class O0(_OptLevel):
    brief = "O0:  Pure FP32 training.\n"
    more = ("Your models are checked to make sure parameters are FP32, but otherwise the\n"
            "types of weights and internal Pytorch operations are not altered.  This mode disables any\n"
            "FP16 arithmetic, although other optimizations like DDP interop may still be requested.\n")

    settings = {"cast_model_type": torch.float32,
                "patch_torch_functions": False,
                "keep_batchnorm_fp32": None,
                "master_weights": False,
                "loss_scale": 1.0}


opt_levels = {"O3": O3(), "O2": O2(), "O1": O1(), "O0": O0()}


def _reset_casting() -> None:
    handle = getattr(_amp_state, "handle", None)
    if handle is not None:
        handle._deactivate()
        del _amp_state.handle


def initialize(models, optimizers=None, enabled: bool = True, opt_level: str = "O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None, loss_scale=None,
               cast_model_outputs=None, num_losses: int = 1, verbosity: int = 1, min_loss_scale=None,
               max_loss_scale: float = 2.0 ** 24, half_dtype: torch.dtype | None = None):
    """Prepare models and optimizers for mixed precision according to ``opt_level`` and overrides.

    Call it once, after building the model(s) and optimizer(s) and before wrapping the model in
    ``DistributedDataParallel``. Any property argument that is not ``None`` overrides the preset.

    Presets: ``O0`` fp32; ``O1`` per-op casting (``torch.autocast``) with dynamic loss scaling; ``O2`` model
    cast to half with batch norm kept in fp32, fp32 master weights inside the optimizer, dynamic loss
    scaling; ``O3`` pure half with a static loss scale of 1.

    The half type: ``cast_model_type`` when given (``torch.float16`` or ``torch.bfloat16``), else
    ``half_dtype`` (an apex extra, also choosing O1's autocast dtype), else fp16 for CUDA models and bf16
    for CPU models; the environment variable ``APEX_AMP_CPU_HALF=fp16`` makes CPU models use fp16 too.

    Returns the model(s) and optimizer(s) in the shape they were passed (a list in gives a list out);
    without optimizers only the model(s).
    """
    _reset_casting()
    _amp_state.opt_properties = Properties()
    _amp_state.verbosity = verbosity

    if not enabled:
        if optimizers is None:
            return models
        return models, optimizers

    if not torch.backends.cudnn.enabled:
        raise RuntimeError("Amp requires torch.backends.cudnn.enabled = True")

    if opt_level not in opt_levels:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. "
            "Options are 'O0', 'O1', 'O2', 'O3'.  Note that in `O0`, `O1`, etc., "
            "the prefix O is the letter O, not the number zero.")
    if half_dtype is not None and half_dtype not in _HALF:
        raise ValueError(f"half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype!r}")
    if not isinstance(num_losses, int) or isinstance(num_losses, bool) or num_losses < 1:
        raise ValueError(f"num_losses must be a positive int, got {num_losses!r}")

    try:
        props = opt_levels[opt_level](_amp_state.opt_properties)
        maybe_print(f"Selected optimization level {opt_levels[opt_level].brief}", True)
        maybe_print("Defaults for this optimization level are:", True)
        for k, v in props.options.items():
            maybe_print(f"{k:22} : {v}", True)

        _amp_state.min_loss_scale = min_loss_scale
        _amp_state.max_loss_scale = max_loss_scale

        maybe_print("Processing user overrides (additional kwargs that are not None)...", True)
        if enabled is not None:
            props.enabled = enabled
        if opt_level is not None:
            props.opt_level = opt_level
        if cast_model_type is not None:
            props.cast_model_type = cast_model_type
        if patch_torch_functions is not None:
            props.patch_torch_functions = patch_torch_functions
        if keep_batchnorm_fp32 is not None:
            props.keep_batchnorm_fp32 = keep_batchnorm_fp32
        if master_weights is not None:
            props.master_weights = master_weights
        if loss_scale is not None:
            props.loss_scale = loss_scale

        # The half type: an explicit cast_model_type wins, then half_dtype, then the device's default.
        device_type = _models_device_type(models)
        if half_dtype is None:
            half_dtype = default_half_dtype(device_type)  # CPU: bf16 unless APEX_AMP_CPU_HALF=fp16
        if cast_model_type is None and props.cast_model_type in _HALF:
            props.options["cast_model_type"] = half_dtype
        elif props.cast_model_type in _HALF:
            half_dtype = props.cast_model_type
        _amp_state.half_dtype = half_dtype
        _amp_state.device_type = device_type

        maybe_print("After processing overrides, optimization options are:", True)
        for k, v in props.options.items():
            maybe_print(f"{k:22} : {v}", True)

        result = _initialize(models, optimizers, props, num_losses, cast_model_outputs)
        if props.patch_torch_functions or props.cast_model_type in _HALF:
            warn_if_slow(device_type, half_dtype, props.opt_level)  # once per process, with a measured factor
        return result
    except Exception:
        # A failed initialize leaves amp uninitialized rather than half configured.
        _reset_casting()
        if hasattr(_amp_state, "opt_properties"):
            del _amp_state.opt_properties
        raise


def state_dict(destination=None) -> OrderedDict:
    """``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, "loss_scaler1": ...}``."""
    if destination is None:
        destination = OrderedDict()
    for idx, loss_scaler in enumerate(getattr(_amp_state, "loss_scalers", [])):
        destination[f"loss_scaler{idx}"] = {
            "loss_scale": loss_scaler.loss_scale(),
            "unskipped": loss_scaler._unskipped,
        }
    return destination


def load_state_dict(state_dict) -> None:
    """Restore the loss scalers from :func:`state_dict`. Unknown keys raise ``RuntimeError`` listing them,
    and nothing is changed."""
    scalers = getattr(_amp_state, "loss_scalers", None)
    if scalers is None:
        raise RuntimeError("amp.load_state_dict was called before amp.initialize; call "
                           "amp.initialize(model, optimizer, opt_level=...) first.")
    if len(state_dict) != len(scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(scalers)} "
              "loss_scalers are used")
    unexpected, entries = [], []
    for key, value in state_dict.items():
        if not (isinstance(key, str) and key.startswith("loss_scaler")):
            unexpected.append(key)
            continue
        if not isinstance(value, dict) or "loss_scale" not in value or "unskipped" not in value:
            raise RuntimeError(f"Error(s) in loading state_dict. Entry \"{key}\" must be a dict with keys "
                               f"'loss_scale' and 'unskipped', got {value!r}.")
        entries.append(value)
    if unexpected:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in unexpected)))
    for idx, value in enumerate(entries):
        if idx > len(scalers) - 1:
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {len(scalers)}")
            break
        scalers[idx]._loss_scale = float(value["loss_scale"])
        scalers[idx]._unskipped = int(value["unskipped"])
