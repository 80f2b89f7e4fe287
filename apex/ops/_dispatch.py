"""apex's custom ops, called without ``torch.library``'s dispatcher when nothing needs it.

Every fused op registers its Triton path as a ``torch.library`` custom op, so that ``torch.compile``
(``fullgraph=True`` included), ``torch.export`` and the other tracers record one opaque node with a fake
implementation. In eager mode that registration costs more host time than the kernel takes on the GPU: the
custom op's autograd wrapper, a ``torch._dynamo`` disable frame, two redispatches and output checks, about
as much again as the op's own Python. :func:`custom_op` registers the same op and returns a
:class:`CustomOp` whose call goes

* through the registered op (``torch.ops.apex.<name>``) while ``torch.compile`` or ``torch.export`` traces,
  under a ``TorchDispatchMode`` (``make_fx``, fake tensors, a FLOP counter, a debugging mode that lists
  ops), inside ``torch.func`` transforms, while ``torch.jit.trace`` records, and for tensor subclasses
  (``DTensor`` and the like): each of these sees exactly what it saw before;
* straight to the op's Python function otherwise (plain tensors, eager mode), inside one plain
  ``autograd.Function`` (:class:`_Eager`) when a gradient is needed, which calls the op's registered
  ``setup_context`` and backward as the custom op's autograd does. Outputs past ``grad_outputs`` (saved
  statistics whose gradient the backward ignores) leave that Function as plain tensors: autograd's
  bookkeeping costs about 2 µs per output.

The backward's own ops are ``CustomOp`` calls too: while a backward runs without ``create_graph`` they skip
the dispatcher as well; with ``create_graph=True`` they take the registered op, so a second derivative
behaves as before (an error where the op had no formula for it, never a silently wrong one).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch._C import _any_requires_grad, _are_functorch_transforms_active, _get_tracing_state
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex.ops._checks import member_set

Tensor = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = member_set(torch.Tensor, torch.nn.Parameter, type(None))


def _plain(args: Iterable[object]) -> bool:
    for a in args:
        if type(a) not in _PLAIN and isinstance(a, Tensor):
            return False
    return True


def eager(args: Iterable[object] = ()) -> bool:
    """True when a call on ``args`` may skip ``torch.library``'s dispatcher: not compiling, exporting or
    tracing, no dispatch mode or ``torch.func`` transform active, no tensor subclass among ``args``."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    return not (_dispatch_modes() or _are_functorch_transforms_active() or _get_tracing_state() is not None
                ) and _plain(args)


class _Eager(torch.autograd.Function):
    """The autograd of a :class:`CustomOp` called in eager mode: its function forward, its registered
    ``setup_context`` and backward. The op and a list for the outputs past ``grad_outputs`` ride as the
    first two arguments (as the custom op's own autograd passes its metadata), so ``ctx.needs_input_grad``
    is sliced to the op's inputs; the backward gets None for those outputs' gradients."""

    @staticmethod
    def forward(ctx, op, rest, *inputs):
        if not op._materialize_grads:
            ctx.set_materialize_grads(False)
        # Sliced once here (autograd reads the attribute only from Python): setup_context and every backward
        # of this node (retain_graph) see the op's own inputs' flags.
        ctx.needs_input_grad = ctx.needs_input_grad[2:]
        out = op._fn(*inputs)
        op._setup(ctx, inputs, out)
        ctx._apex_op = op
        k = op._grad_outputs
        if k is None:
            return out
        rest.extend(out[k:])
        return out[:k]

    @staticmethod
    def backward(ctx, *grads):
        op = ctx._apex_op
        if op._grad_outputs is not None:
            grads = grads + op._no_grads
        result = op._backward(ctx, *grads)
        return (None, None, *result) if isinstance(result, tuple) else (None, None, result)


# autograd.Function.apply's Python wrapper binds defaults and unwraps torch.func's dead wrappers: eager calls
# come here only when no torch.func transform is active (see eager), so they take the C++ apply (~4 µs less).
_eager_apply = super(torch.autograd.Function, _Eager).apply


class CustomOp:
    """A ``torch.library`` custom op (``opdef``, also ``torch.ops.<ns>.<name>``) whose calls skip the
    dispatcher in eager mode (see the module docstring). Registration methods as ``CustomOpDef``'s."""

    def __init__(self, name: str, fn: Callable, mutates_args: tuple[str, ...] | str, materialize_grads: bool,
                 grad_outputs: int | None = None):
        self._fn = fn
        self._grad_outputs = grad_outputs
        self._no_grads: tuple = ()
        self.opdef = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        ns, short = name.split("::")
        self._packet = getattr(getattr(torch.ops, ns), short)  # what torch.compile and export record
        params = list(inspect.signature(fn).parameters.values())
        self._nparams = len(params)
        # The dispatcher hands setup_context every argument, defaults filled in: so does the eager path.
        self._defaults = tuple(p.default for p in params)
        self._mutated = tuple(i for i, p in enumerate(params) if p.name in
                              ((mutates_args,) if isinstance(mutates_args, str) else tuple(mutates_args)))
        self._setup: Callable | None = None
        self._backward: Callable | None = None
        self._materialize_grads = materialize_grads
        # The positions whose schema type is a tensor: only they can hold a tensor subclass (the others are
        # numbers, lists and dtypes), so an eager call checks these instead of every argument.
        schema = self.opdef._opoverload._schema.arguments
        opt = torch._C.OptionalType.ofTensor()
        self._tensor_pos = tuple(i for i, a in enumerate(schema) if a.type.isSubtypeOf(opt))

    def register_fake(self, fn: Callable) -> Callable:
        return self.opdef.register_fake(fn)

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        self.opdef.register_autograd(backward, setup_context=setup_context)
        self._setup, self._backward = setup_context, backward
        if self._grad_outputs is not None:
            outs = self.opdef._opoverload._schema.returns
            self._no_grads = (None,) * (len(outs) - self._grad_outputs)

    def __call__(self, *args):
        # eager(args), inlined (~1.5 µs less a call): the same tests, tensor-typed positions only.
        if (torch.compiler.is_compiling() or torch.compiler.is_exporting() or _dispatch_modes()
                or _are_functorch_transforms_active() or _get_tracing_state() is not None):
            return self._packet(*args)
        if len(args) < self._nparams:
            args = args + self._defaults[len(args):]
        for i in self._tensor_pos:
            a = args[i]
            if type(a) not in _PLAIN_OR_NONE and isinstance(a, Tensor):
                return self._packet(*args)
        if torch.is_grad_enabled() and _any_requires_grad(*args):
            if self._backward is None:  # the registered op answers as before (no formula: its error)
                return self._packet(*args)
            if self._grad_outputs is None:
                return _eager_apply(self, None, *args)
            rest: list = []
            return (*_eager_apply(self, rest, *args), *rest)
        out = self._fn(*args)
        for i in self._mutated:  # as the registered op's ADInplaceOrView kernel does
            if args[i] is not None:
                torch.autograd.graph.increment_version(args[i])
        return out


def custom_op(name: str, *, mutates_args: tuple[str, ...] | str = (), materialize_grads: bool = True,
              grad_outputs: int | None = None) -> Callable[[Callable], CustomOp]:
    """``torch.library.custom_op`` (same name and schema) returning a :class:`CustomOp`.

    ``materialize_grads=False``: the eager backward gets ``None`` for the gradients of outputs that did not
    reach the loss (saved statistics, say) instead of zero tensors, and must accept them (the registered
    op's backward, under ``torch.compile``, still gets zeros). ``grad_outputs=k`` (with
    ``materialize_grads=False``): only the first ``k`` outputs are differentiable in eager mode, the others
    (statistics the backward ignores) come back without a ``grad_fn`` and their gradients as None."""
    if grad_outputs is not None and materialize_grads:
        raise ValueError("grad_outputs needs materialize_grads=False (the backward gets None for the others)")

    def wrap(fn: Callable) -> CustomOp:
        return CustomOp(name, fn, mutates_args, materialize_grads, grad_outputs)
    return wrap


def lazy_module(name: str) -> Callable[[], ModuleType]:
    """A function returning the module ``name``, imported at its first call: an op's kernels (and Triton)
    load when the op first runs, not when apex is imported, and later calls cost a list lookup instead of an
    ``import`` statement's (~1 µs)."""
    box: list[ModuleType] = []
    # An import statement, not importlib.import_module: torch.compile traces the first call too (an op compiled
    # before it ran eagerly), and Dynamo runs an ``import`` statement but breaks the graph at import_module.
    # While tracing, the box is not read: the graph would guard on it, and the box filled later (by the
    # backward's eager call, say) would fail that guard at the next call, a second graph for the same code.
    code: dict = {}
    exec(f"def load():\n    import {name}\n", code)  # noqa: S102 - a module path of apex's own, not input
    load = code["load"]

    def get() -> ModuleType:
        if torch.compiler.is_compiling():
            load()
            return sys.modules[name]
        if not box:
            load()
            box.append(sys.modules[name])
        return box[0]
    return get


def kept_per_key(make: Callable, limit: int = 64) -> Callable:
    """``make(*key)``, kept per key (at most ``limit`` keys): values a call derives from its sizes, dtypes and
    devices alone (bounds, index rows, layouts). Not read or filled while torch.compile traces: the graph
    gets its own constants, and a graph that read the cache would guard on it, which the next eager call
    changes (a second graph for the same code)."""
    kept: dict = {}

    def get(*key):
        if torch.compiler.is_compiling():
            return make(*key)
        got = kept.get(key)
        if got is None:
            if len(kept) >= limit:
                kept.clear()
            got = kept[key] = make(*key)
        return got
    return get
