"""torch.fx analysis behind :class:`~apex.contrib.sparsity.permutation_lib.Permutation`: which tensors share
a channel order.

Every tensor flowing through the traced graph carries a *channel space*; spaces that must be permuted the
same way (a layer's output and its consumers' inputs, the two sides of a residual add, the inputs of a
concatenation, a normalisation's statistics) are merged with union-find. A merged space becomes a
:class:`Group`: the tensors to permute (``Member``: a weight along its input-channel dim "C", or an output
ordered tensor such as a weight's rows, a bias, a norm's affine parameters or running statistics "K") and
the *period* ``p``: the permutation is one permutation of ``p`` channels repeated (tiled) across every
tensor's channel dim. ``p`` is the gcd of the space's channel counts, so a concatenation of 64 and 128
channels or a grouped convolution with 16 input channels per group still gets a consistent permutation.

A space is *poisoned* (never permuted) when it reaches something whose channel order must not change or
that mixes channels in an unknown way: the model's inputs and outputs, unknown operations, transposes,
slicing, GroupNorm and LocalResponseNorm, the output of a grouped convolution, a size mismatch (a flatten
that changes the channel count), a parameter whose channel dim is ambiguous.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Member", "Group", "analyse"]


@dataclass
class Member:
    """One tensor to permute along ``dim``; ``role`` "C" for a weight's input channels, "K" otherwise."""

    name: str
    tensor: torch.Tensor
    dim: int
    role: str
    sparse: bool = False


@dataclass
class Group:
    period: int
    members: list = field(default_factory=list)
    reason: str | None = None  # why the group may not be permuted; None when it may


_NC, _LAST = "nc", "last"  # channel at dim 1 (convolutions) / at the last dim (linear layers)

_PASS_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid,
                 nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                 nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Softmax, nn.Softmin, nn.LogSoftmax,
                 nn.Softmax2d)
_POOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                 nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                 nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Upsample)
_BN_MODULES = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
_PASS_FUNCS = {torch.relu, F.relu, F.relu6, F.gelu, F.silu, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh,
               F.dropout, F.hardswish, F.hardsigmoid, F.leaky_relu, F.elu, F.mish, F.softplus, torch.exp, torch.abs,
               operator.neg, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
_POOL_FUNCS = {F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
               F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool2d,
               F.interpolate}
_PASS_METHODS = {"relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "exp", "abs", "neg", "softmax",
                 "log_softmax", "contiguous", "clone", "float", "half", "bfloat16", "double", "to", "type_as",
                 "detach", "expand"}
_BINARY = {operator.add, operator.sub, operator.mul, operator.truediv, operator.iadd, operator.isub,
           operator.imul, operator.itruediv, torch.add, torch.sub, torch.mul, torch.div, torch.maximum,
           torch.minimum}
_BINARY_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"}
_META_METHODS = {"size", "dim", "numel"}


@dataclass
class _Val:
    """What a graph node produces: a channel tensor (``sid`` set), shape data (``meta``), or an MHA tuple."""

    sid: int | None = None
    size: int | None = None
    layout: str | None = None
    attr: tuple | None = None  # (name, tensor) for a bare parameter/buffer not yet tied to a channel dim
    meta: tuple | None = None  # ("shape", node) | ("dim", node, i) | ("other",)
    mha: int | None = None  # output space of a MultiheadAttention call


class _Analyser:
    def __init__(self, gm: torch.fx.GraphModule, sparse_ids: set):
        self.gm = gm
        self.sparse_ids = sparse_ids
        self.parent: list[int] = []
        self.members: list[list] = []
        self.sizes: list[list] = []
        self.reasons: list[list] = []
        self.vals: dict = {}
        self.owner: dict = {}  # (id(tensor), dim) -> space: a tensor dim shared by two spaces ties them

    # ---- union-find over channel spaces
    def new(self, reason=None) -> int:
        self.parent.append(len(self.parent))
        self.members.append([])
        self.sizes.append([])
        self.reasons.append([reason] if reason else [])
        return len(self.parent) - 1

    def find(self, s: int) -> int:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a
            for lst in (self.members, self.sizes, self.reasons):
                lst[a] += lst[b]
                lst[b] = []
        return a

    def poison(self, v, reason: str) -> None:
        if isinstance(v, _Val):
            for s in (v.sid, v.mha):
                if s is not None:
                    self.reasons[self.find(s)].append(reason)

    def member(self, sid, name, tensor, dim, role) -> None:
        if tensor is None:
            return
        sparse = role == "C" and id(tensor) in self.sparse_ids
        key = (id(tensor), dim)
        if key in self.owner:  # a module called twice, or a tied weight: one order for both uses
            sid = self.union(self.owner[key], sid)
        self.owner[key] = self.find(sid)
        self.members[self.find(sid)].append(Member(name, tensor, dim, role, sparse))

    def tensor_val(self, size, layout, reason=None) -> _Val:
        sid = self.new(reason)
        if size is not None:
            self.sizes[sid].append(size)
        return _Val(sid=sid, size=size, layout=layout)

    # ---- helpers
    def val(self, a):
        return self.vals.get(a) if isinstance(a, torch.fx.Node) else None

    def inputs(self, node):
        out = []
        torch.fx.node.map_arg((node.args, node.kwargs), lambda n: out.append(self.vals.get(n)))
        return out

    def unknown(self, node, why) -> _Val:
        for v in self.inputs(node):
            self.poison(v, f"{why} ({node.name})")
        return self.tensor_val(None, None, f"{why} ({node.name})")

    def resolve_attr(self, v: _Val, size: int, layout: str) -> bool:
        """Tie a bare parameter to a channel space of ``size`` channels: its channel dim must be unambiguous."""
        name, t = v.attr
        dims = [d for d in range(t.dim()) if t.shape[d] == size]
        if len(dims) != 1:
            return False
        d = dims[0]
        if layout == _LAST and d != t.dim() - 1:
            return False
        if layout == _NC and (d == t.dim() - 1 or any(t.shape[i] != 1 for i in range(d))):
            return False  # a 1-d (C,) parameter would broadcast against the last spatial dim, not C
        self.member(v.sid, name, t, d, "K")
        v.attr, v.size, v.layout = None, size, layout
        self.sizes[self.find(v.sid)].append(size)
        return True

    def join(self, vals, node) -> _Val:
        """Elementwise combination: every channel tensor involved shares one order."""
        tens = [v for v in vals if v is not None and v.sid is not None]
        known = [v for v in tens if v.attr is None]
        if not known:
            return self.unknown(node, "elementwise op without a channel tensor")
        base = known[0]
        size, layout, sid = base.size, base.layout, base.sid
        for v in tens:
            if v is base:
                continue
            if v.attr is not None and not self.resolve_attr(v, size, layout):
                self.poison(base, f"parameter with an ambiguous channel dim ({node.name})")
                self.poison(v, "ambiguous parameter")
            elif v.size != size:
                self.poison(base, f"size mismatch at {node.name}")
                self.poison(v, f"size mismatch at {node.name}")
            sid = self.union(sid, v.sid)
        return _Val(sid=sid, size=size, layout=layout)

    def consume(self, v, channels, per_group, name, tensor, layouts, node) -> None:
        if v is None or v.sid is None or v.size != channels or v.layout not in layouts:
            self.poison(v, f"{node.name} cannot take a permuted input")
            return
        self.sizes[self.find(v.sid)].append(per_group)
        self.member(v.sid, name, tensor, 1, "C")

    # ---- node handlers
    def call_module(self, node) -> _Val:
        mod = self.gm.get_submodule(node.target)
        name = str(node.target)
        x = self.val(node.args[0]) if node.args else None
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in mod.parameters(recurse=False)):
            return self.unknown(node, "uninitialized lazy module")
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            c, k, g = mod.in_channels, mod.out_channels, mod.groups
            if g > 1 and g == c == k:  # depthwise: channel k only ever sees channel k
                if x is None or x.sid is None or x.size != c or x.layout != _NC:
                    return self.unknown(node, "depthwise convolution of an unknown input")
                self.member(x.sid, f"{name}.weight", mod.weight, 0, "K")
                self.member(x.sid, f"{name}.bias", mod.bias, 0, "K")
                return x
            self.consume(x, c, c // g, f"{name}.weight", mod.weight, (_NC,), node)
            out = self.tensor_val(k, _NC, "grouped convolution output" if g > 1 else None)
            self.member(out.sid, f"{name}.weight", mod.weight, 0, "K")
            self.member(out.sid, f"{name}.bias", mod.bias, 0, "K")
            return out
        if isinstance(mod, nn.Linear):
            self.consume(x, mod.in_features, mod.in_features, f"{name}.weight", mod.weight, (_LAST,), node)
            out = self.tensor_val(mod.out_features, _LAST)
            self.member(out.sid, f"{name}.weight", mod.weight, 0, "K")
            self.member(out.sid, f"{name}.bias", mod.bias, 0, "K")
            return out
        if isinstance(mod, nn.MultiheadAttention):
            return self.mha(node, mod, name)
        if isinstance(mod, nn.Embedding):
            out = self.tensor_val(mod.embedding_dim, _LAST)
            self.member(out.sid, f"{name}.weight", mod.weight, 1, "K")
            return out
        if isinstance(mod, _BN_MODULES):
            if x is None or x.sid is None or x.size != mod.num_features:
                return self.unknown(node, "normalisation of an unknown input")
            for p in ("weight", "bias", "running_mean", "running_var"):
                self.member(x.sid, f"{name}.{p}", getattr(mod, p, None), 0, "K")
            return x
        if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
            shape = tuple(mod.normalized_shape)
            d = 0 if x is not None and x.layout == _NC else len(shape) - 1
            if x is None or x.sid is None or shape[d] != x.size:
                return self.unknown(node, "layer norm over other dims than the channels")
            self.member(x.sid, f"{name}.weight", getattr(mod, "weight", None), d, "K")
            self.member(x.sid, f"{name}.bias", getattr(mod, "bias", None), d, "K")
            return x
        if isinstance(mod, _PASS_MODULES) and x is not None and x.sid is not None:
            return x
        if isinstance(mod, _POOL_MODULES) and x is not None and x.sid is not None and x.layout == _NC:
            return x
        if isinstance(mod, nn.Flatten) and x is not None and x.sid is not None:
            return self.flatten(x, mod.start_dim, node)
        return self.unknown(node, f"module {type(mod).__name__}")

    def mha(self, node, mod, name) -> _Val:
        q = node.args[0] if node.args else node.kwargs.get("query")
        k = node.args[1] if len(node.args) > 1 else node.kwargs.get("key")
        v = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
        qkv = [self.val(a) for a in (q, k, v)]
        e = mod.embed_dim
        if mod._qkv_same_embed_dim and mod.in_proj_weight is not None and all(
                a is not None and a.sid is not None and a.size == e and a.layout == _LAST for a in qkv):
            sid = qkv[0].sid
            for a in qkv[1:]:
                sid = self.union(sid, a.sid)
            self.sizes[self.find(sid)].append(e)
            self.member(sid, f"{name}.in_proj_weight", mod.in_proj_weight, 1, "C")
        else:
            for a in qkv:
                self.poison(a, f"{name} input")
        out = self.tensor_val(e, _LAST)
        self.member(out.sid, f"{name}.out_proj.weight", mod.out_proj.weight, 0, "K")
        self.member(out.sid, f"{name}.out_proj.bias", mod.out_proj.bias, 0, "K")
        return _Val(mha=out.sid, size=e, layout=_LAST)

    def flatten(self, x, start_dim, node) -> _Val:
        if start_dim != 1 or x.attr is not None:
            self.poison(x, f"flatten at {node.name}")
            return self.tensor_val(None, None, "flatten")
        # the channel count may change (C*H*W); consumers compare their input size with x.size
        return _Val(sid=x.sid, size=x.size, layout=_LAST)

    def cat(self, node) -> _Val:
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        vals = [self.val(t) for t in tensors]
        ok = all(v is not None and v.sid is not None and v.attr is None for v in vals)
        if ok and dim == 0:
            return self.join(vals, node)
        channel = (dim == 1 and all(v.layout == _NC for v in vals)) or (
            dim == -1 and all(v.layout == _LAST for v in vals))
        if not ok or not channel:
            return self.unknown(node, "concatenation")
        sid = vals[0].sid
        for v in vals[1:]:
            sid = self.union(sid, v.sid)
        size = sum(v.size for v in vals)
        self.sizes[self.find(sid)].append(size)
        return _Val(sid=sid, size=size, layout=vals[0].layout)

    def view(self, node, x) -> _Val:
        shape = node.args[1:]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        ref = [self.val(a) for a in shape]
        if x.layout == _NC and len(shape) == 2 and shape[1] == -1:  # x.view(x.size(0), -1): a flatten
            return self.flatten(x, 1, node)
        ok = False
        if x.layout == _NC and len(ref) == 1 and ref[0] is not None and ref[0].meta and ref[0].meta[0] == "shape":
            src = self.vals.get(ref[0].meta[1])
            ok = src is not None and src.size == x.size and src.layout == _NC
        elif x.layout == _NC and len(ref) >= 2 and ref[1] is not None and ref[1].meta and ref[1].meta[0] == "dim":
            src = self.vals.get(ref[1].meta[1])
            ok = ref[1].meta[2] == 1 and src is not None and src.size == x.size and src.layout == _NC
        if not ok:
            return self.unknown(node, "reshape that may move the channels")
        return x

    def call_function(self, node) -> _Val:
        fn = node.target
        vals = self.inputs(node)
        if all(v is None or v.meta for v in vals) and fn is not torch.cat:
            if fn in (operator.getitem, operator.add, operator.mul, operator.sub, operator.floordiv, getattr):
                return self.meta_of(node)
        x = self.val(node.args[0]) if node.args else None
        if fn is getattr:
            return _Val(meta=("shape", node.args[0]) if node.args[1] == "shape" else ("other",))
        if fn is operator.getitem:
            if x is not None and x.mha is not None:  # (output, attention weights): the weights have no channels
                if node.args[1] == 0:
                    return _Val(sid=x.mha, size=x.size, layout=x.layout)
                return self.tensor_val(None, None, "attention weights")
            if x is not None and x.meta:
                return self.meta_of(node)
            return self.unknown(node, "indexing")
        if fn in _BINARY:
            return self.join(vals, node)
        if fn in _PASS_FUNCS and x is not None and x.sid is not None:
            return x
        if fn in _POOL_FUNCS and x is not None and x.sid is not None and x.layout == _NC:
            return x
        if fn is torch.flatten and x is not None and x.sid is not None:
            return self.flatten(x, node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0), node)
        if fn in (torch.cat, torch.concat):
            return self.cat(node)
        return self.unknown(node, f"function {getattr(fn, '__name__', fn)}")

    def meta_of(self, node) -> _Val:
        if node.target is operator.getitem:
            base = self.val(node.args[0])
            if base is not None and base.meta and base.meta[0] == "shape" and isinstance(node.args[1], int):
                return _Val(meta=("dim", base.meta[1], node.args[1]))
        return _Val(meta=("other",))

    def call_method(self, node) -> _Val:
        m = node.target
        x = self.val(node.args[0])
        if m in _META_METHODS:
            if m == "size" and len(node.args) == 1 and not node.kwargs:
                return _Val(meta=("shape", node.args[0]))
            if m == "size" and len(node.args) == 2 and isinstance(node.args[1], int):
                return _Val(meta=("dim", node.args[0], node.args[1]))
            return _Val(meta=("other",))
        if x is None or x.sid is None:
            return self.unknown(node, f"method {m}")
        if m in _BINARY_METHODS:
            return self.join(self.inputs(node), node)
        if m == "expand_as" or m in _PASS_METHODS:
            return x
        if m in ("view", "reshape") and x.attr is None:
            return self.view(node, x)
        if m == "flatten":
            return self.flatten(x, node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0), node)
        return self.unknown(node, f"method {m}")

    def get_attr(self, node) -> _Val:
        t = self.gm
        for part in str(node.target).split("."):
            t = getattr(t, part)
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.parameter.UninitializedParameter):
            return self.tensor_val(None, None, f"attribute {node.target}")
        return _Val(sid=self.new(), attr=(str(node.target), t))

    def run(self) -> list:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.vals[node] = self.tensor_val(None, None, "model input")
            elif node.op == "output":
                for v in self.inputs(node):
                    self.poison(v, "model output")
            else:
                self.vals[node] = getattr(self, node.op)(node)
        return self.groups()

    def groups(self) -> list:
        out = []
        for s in range(len(self.parent)):
            if self.find(s) != s or not self.members[s]:
                continue
            seen, members = set(), []
            for m in self.members[s]:
                key = (id(m.tensor), m.dim)
                if key not in seen:
                    seen.add(key)
                    members.append(m)
            sizes = [n for n in self.sizes[s] if n]
            period = math.gcd(*sizes) if sizes else 0
            reason = self.reasons[s][0] if self.reasons[s] else None
            if reason is None and any(m.tensor.shape[m.dim] % max(period, 1) for m in members):
                reason = "channel counts do not tile"
            out.append(Group(period=period, members=members, reason=reason))
        return out


def analyse(gm: torch.fx.GraphModule, sparse_tensors) -> list:
    """Groups of tensors that must share one channel permutation (see the module docstring)."""
    return _Analyser(gm, {id(t) for t in sparse_tensors}).run()
