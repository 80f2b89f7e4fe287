"""Compatibility module for code that does ``import scaled_softmax_cuda`` (Apex's compiled extension).

Names are resolved on first access from ``apex.ops.scaled_masked_softmax``; unlike the CUDA build there is
no shape limit, and fp32 is accepted beside fp16/bf16.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {
    "forward": "apex.ops.scaled_masked_softmax:softmax_forward",
    "backward": "apex.ops.scaled_masked_softmax:softmax_backward",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
