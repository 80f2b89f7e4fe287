"""Apex's manual mixed-precision helpers: model conversion and master-parameter bookkeeping."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

_BN = torch.nn.modules.batchnorm._BatchNorm


class tofp16(nn.Module):
    """Module whose ``forward(input)`` returns ``input.half()``."""

    def forward(self, input):
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Convert every affine batch-norm layer inside ``module`` back to fp32 (for :func:`network_to_half`)."""
    if isinstance(module, _BN) and module.affine is True:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``nn.Sequential(tofp16(), network.half())`` with batch norm kept in fp32."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Convert ``module``'s own (not its children's) floating-point parameters, grads and buffers."""
    for param in module.parameters(recurse=False):
        if param is not None:
            if param.data.dtype.is_floating_point:
                param.data = param.data.to(dtype=dtype)
            if param._grad is not None and param._grad.data.dtype.is_floating_point:
                param._grad.data = param._grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.data.dtype.is_floating_point:
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Convert a network's parameters and buffers to ``dtype``, leaving affine batch norms in fp32."""
    for module in network.modules():
        if isinstance(module, _BN) and module.affine is True:
            continue
        convert_module(module, dtype)
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """Wrap ``network`` converted to half (batch norm kept fp32); inputs are cast to half on the way in.

    ``dtype`` (an apex extra) picks the half type: ``torch.float16`` (Apex's behaviour) or ``torch.bfloat16``.
    """

    def __init__(self, network: nn.Module, dtype: torch.dtype = torch.half):
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype
        self.network = convert_network(network, dtype=dtype)

    def forward(self, *inputs):
        inputs = tuple(t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                       for t in inputs)
        return self.network(*inputs)


def backwards_debug_hook(grad):
    """A gradient hook that raises ``RuntimeError``: registered on master parameters to catch a backward
    that reaches them (masters are updated from copied gradients, never by autograd).
    """
    raise RuntimeError("master_params recieved a gradient in the backward pass!")


def prep_param_lists(model: nn.Module, flat_master: bool = False):
    """``(model_params, master_params)``: the model's trainable parameters and fp32 copies of them.

    With ``flat_master=True`` the masters are one flat fp32 ``nn.Parameter`` (with a ``.grad`` buffer
    already allocated); parameters of several dtypes are flattened with type promotion, as Apex's
    ``_flatten_dense_tensors`` call does on current PyTorch.
    """
    model_params = [param for param in model.parameters() if param.requires_grad]
    if flat_master:
        try:
            master = _flatten_dense_tensors([param.data for param in model_params]).float()
        except RuntimeError:
            print("Error in prep_param_lists:  model may contain a mixture of parameters "
                  "of different types.  Use flat_master=False, or use F16_Optimizer.")
            raise
        master = torch.nn.Parameter(master)
        master.requires_grad = True
        if master.grad is None:
            master.grad = master.new(*master.size())
        return model_params, [master]
    master_params = [param.clone().float().detach() for param in model_params]
    for param in master_params:
        param.requires_grad = True
    return model_params, master_params


def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the model gradients into the master gradients (allocating them if needed)."""
    if flat_master:
        master_params[0].grad.data.copy_(_flatten_dense_tensors([p.grad.data for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is not None:
            if master.grad is None:
                master.grad = torch.empty_like(master.data)
            master.grad.data.copy_(model.grad.data)
        else:
            master.grad = None


def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the master parameters into the model parameters (rounding to the model's dtype)."""
    if flat_master:
        for model, master in zip(model_params, _unflatten_dense_tensors(master_params[0].data, model_params)):
            model.data.copy_(master)
        return
    for model, master in zip(model_params, master_params):
        model.data.copy_(master.data)


def _masters_for_group(param_group: dict, state, what: str, on_param=None):
    """Replace each trainable fp16/bf16 parameter of an optimizer's ``param_group`` by an fp32 master copy.

    A half parameter's optimizer ``state`` entry moves to its master; fp32 parameters stay. ``on_param`` is
    called with each accepted parameter, in order. Returns ``(half_params, fp32_params, masters)``. Any
    other dtype raises a TypeError that starts with ``what``.
    """
    half_params, fp32_params, masters = [], [], []
    for i, param in enumerate(param_group["params"]):
        if not param.requires_grad:
            continue
        if param.dtype in (torch.float16, torch.bfloat16):
            if on_param is not None:
                on_param(param)
            half_params.append(param)
            master = param.detach().clone().float()
            master.requires_grad = True
            param_group["params"][i] = master
            masters.append(master)
            if param in state:
                state[master] = state.pop(param)
        elif param.dtype == torch.float32:
            if on_param is not None:
                on_param(param)
            fp32_params.append(param)
        else:
            raise TypeError(f"{what} must be float32, float16 or bfloat16 tensors. Received {param.type()}")
    return half_params, fp32_params, masters


def to_python_float(t) -> float:
    """``t.item()`` for tensors, ``t[0]`` for indexables."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]


clip_grad_norm = torch.nn.utils.clip_grad_norm_
