"""apex.amp: automatic mixed precision with Apex's API (``amp.initialize``, ``amp.scale_loss``, O0-O3).

Runs on CUDA and CPU models, in fp16 or bf16 (bf16 by default on CPUs). O1 is built on ``torch.autocast``;
O2 keeps fp32 master weights inside the optimizer; loss scaling uses the fused unscale operators.
"""

from apex.amp import lists  # Apex's O1 function lists (amp.lists.functional_overrides, ...), editable before O1
from apex.amp._amp_state import _amp_state, master_params
from apex.amp.amp import (
    bfloat16_function,
    float_function,
    half_function,
    init,
    promote_function,
    register_bfloat16_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from apex.amp.frontend import initialize, load_state_dict, opt_levels, state_dict
from apex.amp.handle import disable_casts, scale_loss

__all__ = [
    "_amp_state",
    "bfloat16_function",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "lists",
    "load_state_dict",
    "master_params",
    "opt_levels",
    "promote_function",
    "register_bfloat16_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
