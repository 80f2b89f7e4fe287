"""Apex's O1 function lists, by module: ``functional_overrides`` (``torch.nn.functional``),
``torch_overrides`` (``torch``) and ``tensor_overrides`` (``torch.Tensor``).

Each has Apex's ``MODULE``, ``FP16_FUNCS``, ``FP32_FUNCS``, ``CASTS`` and ``SEQUENCE_CASTS`` (and
``BANNED_FUNCS`` in ``functional_overrides``) with Apex's contents. O1 reads them when it starts
(``amp.initialize(..., opt_level="O1")`` or ``amp.init()``), so code that edits them first, as Apex's users
did, gets its edits::

    from apex import amp
    amp.lists.functional_overrides.FP32_FUNCS.remove("softmax")
    amp.lists.functional_overrides.FP16_FUNCS.append("softmax")   # softmax in half precision under O1

O1 runs on ``torch.autocast``, which has its own per-device lists; what the edits change is in
:func:`apex.amp._fp32_lists.patch_edits` and docs/amp.md ("Apex's function lists").
"""

from apex.amp.lists import functional_overrides, tensor_overrides, torch_overrides

__all__ = ["functional_overrides", "tensor_overrides", "torch_overrides"]
