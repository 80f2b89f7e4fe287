"""Compatibility module for code that does ``import fused_adam_cuda`` (Apex's legacy contrib Adam, used by
``apex.contrib.optimizers.FusedAdam`` and fairseq's ``FusedAdamV1``).

Every name is an apex operation with Apex's positional signature (see ``apex.ops.legacy_adam``); names are
resolved on first access, so ``import fused_adam_cuda`` stays cheap.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS = {
    "adam": "apex.ops.legacy_adam",
    "reversible_adam": "apex.ops.legacy_adam",
    "adam_mt": "apex.ops.legacy_adam",
    "maybe_adam_undo": "apex.ops.legacy_adam",
    "maybe_cast": "apex.ops.legacy_adam",
    "maybe_cast_mt": "apex.ops.legacy_adam",
    "strided_check_finite": "apex.ops.legacy_adam",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
