"""Pre-grad passes (run by Inductor on the captured FX graph before autograd) when
``config.enable_pre_grad_pass``; ``config.pre_grad_pass_options`` names which.

``cudnn_layer_norm``: every ``F.layer_norm`` call with a weight and a bias becomes
``torch.ops.cudnn.layer_norm(...)[0]`` (same math; Apex's cuDNN layer norm). Counts go to
``torch._dynamo.utils.counters["torchsched"]["pre_grad_<name>"]``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from apex.contrib.torchsched import config

__all__ = ["pre_grad_custom_pass"]

log = logging.getLogger(__name__)

_LAYER_NORMS = (torch.nn.functional.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm.default)


def _layer_norm_args(node: torch.fx.Node):
    """``(x, normalized_shape, weight, bias, eps)`` of a layer-norm call, or None if it does not qualify."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    values = dict(zip(names, node.args))
    for k, v in node.kwargs.items():
        values["input" if k == "input" else k] = v
    values.setdefault("eps", 1e-5)
    if values.get("weight") is None or values.get("bias") is None or "normalized_shape" not in values:
        return None
    shape = values["normalized_shape"]
    shape = [shape] if isinstance(shape, int) else shape
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) for s in shape):
        return None
    return values["input"], list(shape), values["weight"], values["bias"], values["eps"]


def replace_layer_norm(graph: torch.fx.Graph) -> int:
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _LAYER_NORMS:
            continue
        args = _layer_norm_args(node)
        if args is None:
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.cudnn.layer_norm.default, args)
            y = graph.call_function(operator.getitem, (fused, 0))
        y.meta.update(node.meta)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        replaced += 1
    return replaced


PRE_GRAD_PASSES: dict[str, Callable[[torch.fx.Graph], int]] = {"cudnn_layer_norm": replace_layer_norm}


class _PreGradPass(CustomGraphPass):
    """The configured passes, with a uuid so Inductor's graph cache stays usable."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        import apex.contrib.torchsched.ops  # noqa: F401  (registers torch.ops.cudnn)

        for name in config.pre_grad_pass_options:
            if name not in PRE_GRAD_PASSES:
                raise ValueError(f"unknown pre_grad pass {name!r}; known: {sorted(PRE_GRAD_PASSES)}")
            n = PRE_GRAD_PASSES[name](graph)
            counters["torchsched"][f"pre_grad_{name}"] += n
            log.debug("pre-grad pass %s replaced %d sub-graphs", name, n)
        graph.lint()

    def uuid(self):
        return ("apex.torchsched.pre_grad", tuple(config.pre_grad_pass_options))


pre_grad_custom_pass = _PreGradPass()
