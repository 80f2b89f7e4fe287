"""Building blocks of ``DistributedFusedAdam``: the bucket/fragment records (Apex's names, which NeMo's
``MegatronDistributedFusedAdam`` reads), bit helpers for bf16 parameters with 16-bit remainders, and the
adapters behind the ``distributed_adam_cuda`` compatibility module.

Layout. Parameters are flattened and packed, in the order they are initialised, into buckets of
``bucket_size = shard_size * distributed_size`` elements; each parameter starts at a multiple of
``alignment`` elements and may span several buckets (one ``ParameterFragment`` per bucket). Rank ``r``
owns elements ``[r * shard_size, (r + 1) * shard_size)`` of every bucket: the optimizer state
(``StateBucket``) holds only that shard.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from dataclasses import dataclass, field

import torch

from apex import _backend
from apex._kernels._lists import Column, column

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class ParameterFragment:
    """Where one piece of a parameter lives: in the flattened parameter, in its bucket and (if this rank
    owns part of it) in the local shard."""

    param_group_id: int
    param_id: int
    bucket_id: int
    param_range: tuple[int, int]
    bucket_range: tuple[int, int]
    in_local_shard: bool
    shard_range: tuple[int, int] | None
    shard_bucket_range: tuple[int, int] | None
    shard_param_range: tuple[int, int] | None


class StateBucket:
    """Optimizer state of one bucket: this rank's shard of the moments and of the master parameters
    (``params_shard``, in ``dtype``) or of the bf16 remainders (``param_remainders_shard``, int16)."""

    def __init__(self, bucket_size: int, shard_size: int, dtype: torch.dtype, device: torch.device,
                 grad_sync_dtype: torch.dtype, param_sync_dtype: torch.dtype, contiguous_buffer_offset: int = 0,
                 store_params: bool = False, store_param_remainders: bool = False):
        self.bucket_size = bucket_size
        self.shard_size = shard_size
        self.dtype = dtype
        self.grad_sync_dtype = grad_sync_dtype
        self.param_sync_dtype = param_sync_dtype
        self.filled_size = 0
        self.able_to_fill = True
        self.contiguous_buffer_offset = contiguous_buffer_offset
        self.fragments: list[ParameterFragment] = []
        self.params_shard = torch.zeros([shard_size], dtype=dtype, device=device) if store_params else None
        self.param_remainders_shard = (torch.zeros([shard_size], dtype=torch.int16, device=device)
                                       if store_param_remainders else None)
        self.exp_avg_shard = torch.zeros([shard_size], dtype=dtype, device=device)
        self.exp_avg_sq_shard = torch.zeros([shard_size], dtype=dtype, device=device)

    def dtypes(self) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        return self.dtype, self.grad_sync_dtype, self.param_sync_dtype

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds for the bucket."""
        tensors = (self.params_shard, self.param_remainders_shard, self.exp_avg_shard, self.exp_avg_sq_shard)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class GradientStatus(enum.Enum):
    READY = enum.auto()
    PARTIALLY_FILLED = enum.auto()
    FULLY_FILLED = enum.auto()
    SYNCING = enum.auto()


class ParameterStatus(enum.Enum):
    SHARDED = enum.auto()
    SYNCING = enum.auto()
    READY = enum.auto()


@dataclass(eq=False)
class GradientBucket:
    """Gradients of one bucket between backward and step: the local contribution (``grads_bucket``), the
    reduce-scatter output in flight (``sync_grads_shard``) and the reduced local shard (``grads_shard``)."""

    grads_shard: torch.Tensor | None = None
    grads_bucket: torch.Tensor | None = None
    sync_grads_shard: torch.Tensor | None = None
    status: GradientStatus = GradientStatus.READY
    grads_generated: set = field(default_factory=set)
    work: object = None
    # (param_group_id, param_id) of the fragments written into ``grads_bucket`` since it was handed out, when
    # it was handed out unzeroed (see ``ZeroCommMixin._grads_bucket_for``); None: it starts zeroed.
    written: set | None = None
    # (parameter, view of its place in ``grads_bucket``) queued by the hook's fast path (``_zero_deferred``).
    deferred: list = field(default_factory=list)

    def note_generated(self, key: tuple[int, int], fragments: int) -> None:
        """Count fragment ``key`` (param_group_id, param_id) as having its gradient; the bucket is full once
        all of its ``fragments`` have."""
        self.grads_generated.add(key)
        if len(self.grads_generated) == fragments:
            self.status = GradientStatus.FULLY_FILLED


@dataclass(eq=False)
class ParameterBucket:
    """Parameters of one bucket between step and the next forward: the updated local shard and the
    all-gathered bucket."""

    params_shard: torch.Tensor | None = None
    params_bucket: torch.Tensor | None = None
    status: ParameterStatus = ParameterStatus.SHARDED
    params_updated: set = field(default_factory=set)
    work: object = None
    params_needed: int | None = None  # parameters with a fragment in the bucket (counted at first use)
    own_written: bool = False  # this rank's shard of params_bucket is already in the parameters


def _round_to_multiple(number: int, multiple: int, round_up: bool = True) -> int:
    return (number + multiple - 1 if round_up else number) // multiple * multiple


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view in memory order (a channels-last 4-D tensor is read as NHWC, as Apex does)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        t = t.permute(0, 2, 3, 1)
    return t.detach().view(-1)


def _copy_cast(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` between floating dtypes; with an integer dtype on either side the most significant
    bytes are copied and the rest zeroed (Apex's trick for sending parameters as ints; little-endian)."""
    if src.numel() == 0 or src.data_ptr() == dst.data_ptr() and src.dtype == dst.dtype:
        return
    if src.is_floating_point() and dst.is_floating_point():
        dst.copy_(src)
        return
    in_bytes = src.unsqueeze(-1).view(torch.uint8)
    out_bytes = dst.unsqueeze(-1).view(torch.uint8)
    n = min(in_bytes.size(-1), out_bytes.size(-1))
    out_bytes[..., -n:].copy_(in_bytes[..., -n:])
    if n < out_bytes.size(-1):
        out_bytes[..., :-n].zero_()


def _multi_tensor_copy(buffers_in, buffers_out, dummy_overflow_buf: torch.Tensor | None = None) -> None:
    """Copy ``buffers_in[i]`` into ``buffers_out[i]`` (casting), one foreach copy per (dtype, dtype) pair."""
    if buffers_in is buffers_out or (type(buffers_in) is Column and type(buffers_out) is Column and
                                     (buffers_in.ptrs, buffers_in.dtypes) == (buffers_out.ptrs, buffers_out.dtypes)):
        return  # every pair is a self copy (Adam's master is the all-gather's input)
    if len(buffers_in) == 1 and len(buffers_out) == 1:  # a single pair (Adam on one run): no grouping
        _copy_cast(buffers_in[0], buffers_out[0])
        return
    _run_copy_plan(_copy_plan(buffers_in, buffers_out))


def _copy_plan(buffers_in, buffers_out, keep: bool = False) -> list:
    """The pairs of :func:`_multi_tensor_copy` grouped by (dtypes, devices), without empty and self copies:
    ``[(floating, ins, outs, flag)]``. Worth keeping when the same views are copied every step: with ``keep``
    a floating group on one device is held as Columns (addresses read once; the views hold their storage)
    with a flag tensor for the multi-tensor copy of :func:`_run_copy_plan`."""
    groups: dict = {}
    for a, b in zip(buffers_in, buffers_out):
        if a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype):
            continue
        ins, outs = groups.setdefault((a.dtype, b.dtype, a.device, b.device), ([], []))
        ins.append(a)
        outs.append(b)
    plan = []
    for (din, dout, dev_in, dev_out), (ins, outs) in groups.items():
        floating = din.is_floating_point and dout.is_floating_point
        flag = None
        if keep and floating and dev_in == dev_out:
            ins, outs = column(ins, dtype=din, device=dev_in), column(outs, dtype=dout, device=dev_out)
            flag = torch.zeros([1], dtype=torch.int32, device=dev_in)
        plan.append((floating, ins, outs, flag))
    return plan


def _run_copy_plan(plan: list) -> None:
    for floating, ins, outs, flag in plan:
        if not floating:
            for a, b in zip(ins, outs):
                _copy_cast(a, b)
        elif flag is not None and _backend.select_tensor(flag) == "triton":
            # Apex's own copy (multi_tensor_scale by 1.0): one launch over the group, its device table
            # cached on the Columns' addresses, where torch._foreach_copy_ reads every tensor each call.
            # x * 1.0 in fp32 rounded once to the output dtype is the cast copy_ makes, bit for bit.
            from apex.ops.multi_tensor_scale import multi_tensor_scale

            multi_tensor_scale(2048 * 32, flag, [ins, outs], 1.0)
        else:
            torch._foreach_copy_(outs, ins)


@contextlib.contextmanager
def _disable_pre_forward_hook(param: torch.nn.Parameter):
    """Let code touch ``param`` without triggering its pending parameter sync."""
    enabled = getattr(param, "_pre_forward_hook_is_enabled", False)
    if enabled:
        param._pre_forward_hook_is_enabled = False
    try:
        yield
    finally:
        if enabled:
            param._pre_forward_hook_is_enabled = True


@torch.no_grad()
def _bf16_rem_to_fp32(bf16: torch.Tensor, rem: torch.Tensor, fp32: torch.Tensor) -> None:
    """Rebuild fp32 values from bf16 values and the int16 low halves: exact inverse of
    :func:`_fp32_to_bf16_rem`. A negative remainder means the bf16 half was rounded up, so 1 is taken off."""
    assert bf16.shape == rem.shape == fp32.shape
    assert bf16.dtype == torch.bfloat16 and rem.dtype == torch.int16 and fp32.dtype == torch.float32
    hi = bf16.view(torch.int16).to(torch.int32) - (rem < 0).to(torch.int32)
    bits = (hi << 16) | (rem.to(torch.int32) & 0xFFFF)
    fp32.copy_(bits.view(torch.float32))


@torch.no_grad()
def _fp32_to_bf16_rem(fp32: torch.Tensor, bf16: torch.Tensor, rem: torch.Tensor) -> None:
    """Split fp32 values into a bf16 value (the high half, rounded up when bit 15 of the low half is set,
    as Apex's kernel does) and the int16 low half."""
    bits = fp32.contiguous().view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)  # wraps: values >= 2**15 become negative
    hi = (bits >> 16) + (low < 0).to(torch.int32)
    rem.copy_(low)
    bf16.view(torch.int16).copy_(hi.to(torch.int16))


# ----------------------------------------------------------------------------------------------------------
# distributed_adam_cuda's kernels, with Apex's positional signatures, on apex.ops.multi_tensor_adam.


def no_grad(fn):
    """``torch.no_grad()`` as a decorator for what the step and the backward's hooks call with grad mode already
    off: the mode is switched only when it is on (the decorator enters a new context object on every call, a few
    microseconds each, four times a step)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def _as_list(x):
    """A tensor list as given when it is a Column (apex's kept lists), else a list of it."""
    return x if type(x) is Column else list(x)


def _work(p_in, m):
    """The parameters Adam updates in the state's dtype: ``p_in`` itself (a Column stays one) when the
    dtypes agree, else cast copies."""
    if all(p.dtype == m_.dtype for p, m_ in zip(p_in, m)):
        return p_in
    return [p if p.dtype == m_.dtype else p.to(m_.dtype) for p, m_ in zip(p_in, m)]


def _scaled_grads(grads, grad_scale: torch.Tensor):
    if grad_scale.device.type == "cpu" and float(grad_scale) == 1.0 and all(g.dtype == torch.float32 for g in grads):
        # the common unscaled step: no pass over the gradients (reading 1.0 costs no sync); a Column stays one
        return grads if type(grads) is Column else list(grads)
    scale = grad_scale.to(device=grads[0].device, dtype=torch.float32).reshape(())
    return torch._foreach_mul([g.float() for g in grads], scale)


@no_grad
def multi_tensor_fused_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, grad_scale: torch.Tensor,
                            lr: float, beta1: float, beta2: float, eps: float, step: int, mode: int,
                            bias_correction: int, weight_decay: float) -> None:
    """``tensor_lists = [p_in, m, v, g, p_out]``: Adam on ``p_in`` (updated in place) with ``g * grad_scale``,
    then ``p_out`` receives ``p_in`` cast to its dtype (integer ``p_out``: the most significant bytes)."""
    from apex.ops.multi_tensor_adam import multi_tensor_adam

    p_in, m, v, g, p_out = (_as_list(x) for x in tensor_lists)
    if not p_in:
        return
    work = _work(p_in, m)
    multi_tensor_adam(chunk_size, noop_flag, [_scaled_grads(g, grad_scale), work, m, v], lr, beta1, beta2, eps,
                      int(step), mode, bias_correction, weight_decay, validate=False)
    _multi_tensor_copy(work, p_in)
    _multi_tensor_copy(p_in, p_out)


@torch.no_grad()
def multi_tensor_fused_adam_capturable(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                       grad_scale: torch.Tensor, lr: torch.Tensor, beta1: float, beta2: float,
                                       eps: float, step: torch.Tensor, mode: int, bias_correction: int,
                                       weight_decay: float) -> None:
    """As :func:`multi_tensor_fused_adam` with ``lr`` and ``step`` as device tensors; nothing changes when
    ``noop_flag`` is set."""
    from apex.ops.multi_tensor_adam import multi_tensor_adam_capturable

    p_in, m, v, g, p_out = (_as_list(x) for x in tensor_lists)
    if not p_in:
        return
    work = _work(p_in, m)
    one = torch.ones((), dtype=torch.float32, device=p_in[0].device)
    multi_tensor_adam_capturable(chunk_size, noop_flag, [_scaled_grads(g, grad_scale), work, m, v], lr, beta1,
                                 beta2, eps, step, mode, bias_correction, weight_decay, one, validate=False)
    _multi_tensor_copy(work, p_in)
    _multi_tensor_copy(p_in, p_out)


@torch.no_grad()
def multi_tensor_fused_adam_with_param_remainders(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                                  grad_scale: torch.Tensor, lr: float, beta1: float, beta2: float,
                                                  eps: float, step: int, mode: int, bias_correction: int,
                                                  weight_decay: float) -> None:
    """``tensor_lists = [p_in (bf16), p_rem (int16), m, v, g, p_out (bf16)]``: the fp32 master is rebuilt
    exactly from ``p_in`` and ``p_rem``, updated, and split again into ``p_out`` and ``p_rem``."""
    from apex.ops.multi_tensor_adam import multi_tensor_adam

    p_in, rem, m, v, g, p_out = (list(x) for x in tensor_lists)
    if not p_in:
        return
    masters = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in p_in]
    for p, r, w in zip(p_in, rem, masters):
        _bf16_rem_to_fp32(p, r, w)
    multi_tensor_adam(chunk_size, noop_flag, [_scaled_grads(g, grad_scale), masters, m, v], lr, beta1, beta2,
                      eps, int(step), mode, bias_correction, weight_decay, validate=False)
    for w, o, r in zip(masters, p_out, rem):
        _fp32_to_bf16_rem(w, o, r)
