"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Both sides agree on ``tensor_shape`` and dtype ahead of time (no shape handshake): the receiver allocates
``tensor_shape`` of ``dtype`` (``dtype_``/``dtype``, else ``params_dtype``, else float32; float32 when
``fp32_residual_connection``) and the sender's tensor must have that shape (a ValueError names both shapes
otherwise) — it is cast to that dtype before sending. All operations of one call are posted together with
``torch.distributed.batch_isend_irecv`` (or separate isend/irecv when ``batch_p2p_comm=False``) on the
pipeline group, so they work on Gloo and NCCL; a peer that never answers fails with the group's timeout.
Receive buffers go where the call's tensors are; without one, to the current GPU on NCCL and to torch's
default device on Gloo. Gloo's send/recv cannot read or write device memory, so on a Gloo group GPU tensors
travel through host copies.
With ``async_comm=True`` received tensors come back as :class:`FutureTensor` (already complete: see _communicate).

Like upstream (which forces it off), activations are sent whole: there is no scatter/gather over the tensor
parallel group; with ``sequence_parallel_enabled`` the caller passes the per-rank (sequence-split) shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from apex.transformer import parallel_state
from apex.transformer.pipeline_parallel._timers import _Timers

Shape = list[int] | torch.Size

__all__ = [
    "FutureTensor",
    "recv_forward",
    "recv_backward",
    "send_forward",
    "send_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
]


class FutureTensor:
    """A received tensor whose communication may still be in flight; ``get()`` waits and returns it."""

    def __init__(self, tensor: torch.Tensor, waitfunc: Callable[[], None]) -> None:
        self.tensor = tensor
        self.waitfunc = waitfunc

    def get(self) -> torch.Tensor:
        if self.waitfunc is not None:
            self.waitfunc()
            self.waitfunc = None
        return self.tensor


def _device(*tensors: torch.Tensor | None) -> torch.device | None:
    """Where received tensors go: the device of the tensors sent in the same call, else the current GPU on
    NCCL, else (None) torch's default device."""
    for t in tensors:
        if t is not None:
            return t.device
    group = parallel_state.get_pipeline_model_parallel_group()
    if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _needs_host_copy(tensor: torch.Tensor) -> bool:
    """Gloo's send/recv hand the tensor's address to its TCP transport, which cannot read device memory."""
    return tensor.device.type != "cpu"


class _HostStaged:
    """The works of a batch whose device tensors travel through host copies; ``wait()`` waits for them, then
    copies what was received into the device tensors."""

    def __init__(self, works: list, received: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._works, self._received = works, received

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        for target, host in self._received:
            target.data.copy_(host)  # .data: the receive buffer is a leaf that requires grad
        self._works = self._received = []
        return True


def _prepare_send(tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, what: str):
    if tensor is None:
        return None
    if isinstance(tensor, FutureTensor):
        tensor = tensor.get()
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{what} has shape {tuple(tensor.shape)} but the stages agreed on tensor_shape={shape}"
        )
    return tensor.detach().to(dtype).contiguous()


def _run_p2pops(
    tensor_send_prev: torch.Tensor | None,
    tensor_send_next: torch.Tensor | None,
    tensor_recv_prev: torch.Tensor | None,
    tensor_recv_next: torch.Tensor | None,
    async_comm: bool = False,
    batch_p2p_comm: bool = True,
) -> list:
    """Post the sends and receives (Megatron's order: prev before next) and return their work handles."""
    group = parallel_state.get_pipeline_model_parallel_group()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    ops = []
    if tensor_send_prev is not None:
        ops.append(dist.P2POp(dist.isend, tensor_send_prev, prev_rank, group))
    if tensor_recv_prev is not None:
        ops.append(dist.P2POp(dist.irecv, tensor_recv_prev, prev_rank, group))
    if tensor_send_next is not None:
        ops.append(dist.P2POp(dist.isend, tensor_send_next, next_rank, group))
    if tensor_recv_next is not None:
        ops.append(dist.P2POp(dist.irecv, tensor_recv_next, next_rank, group))
    if not ops:
        return []
    received = []
    if dist.get_backend(group) == "gloo" and any(_needs_host_copy(op.tensor) for op in ops):
        staged = []
        for op in ops:
            host = op.tensor
            if _needs_host_copy(host):
                if op.op is dist.irecv:
                    host = torch.empty(host.shape, dtype=host.dtype, device="cpu")
                    received.append((op.tensor, host))
                else:
                    host = host.to("cpu")
            staged.append(dist.P2POp(op.op, host, op.peer, op.group))
        ops = staged
    if batch_p2p_comm:
        works = list(dist.batch_isend_irecv(ops))
    else:
        works = [op.op(op.tensor, op.peer, op.group) for op in ops]
    return [_HostStaged(works, received)] if received else works


def _communicate(
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape | None = None,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    dtype_: torch.dtype | None = None,
    *,
    scatter_gather_tensors_in_pipeline: bool = True,
    params_dtype: torch.dtype | None = None,
    fp32_residual_connection: bool = False,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
) -> tuple[torch.Tensor | FutureTensor | None, torch.Tensor | FutureTensor | None, list | None]:
    """Send to / receive from the neighbouring stages; returns ``(recv_prev, recv_next, wait_handles)``.

    ``wait_handles`` is the list of work handles when ``overlap_p2p_comm`` (the caller waits), else None.
    """
    if tensor_shape is None:
        raise RuntimeError(
            "`tensor_shape` must be specified. Common `tensor_shape` is `(seq_length, micro_batch_size, hidden_size)`"
        )
    shape = tuple(int(s) for s in tensor_shape)
    if any(s <= 0 for s in shape):
        raise ValueError(f"tensor_shape must have positive sizes, got {shape}")
    dtype = params_dtype or torch.float
    if fp32_residual_connection:
        dtype = torch.float
    if dtype_ is not None:
        dtype = dtype_
    send_next = _prepare_send(tensor_send_next, shape, dtype, "the tensor sent to the next stage")
    send_prev = _prepare_send(tensor_send_prev, shape, dtype, "the tensor sent to the previous stage")
    device = _device(send_next, send_prev)
    # Received tensors are leaves that require grad: the stage's backward reads their .grad.
    tensor_recv_prev = torch.empty(shape, dtype=dtype, device=device, requires_grad=True) if recv_prev else None
    tensor_recv_next = torch.empty(shape, dtype=dtype, device=device, requires_grad=True) if recv_next else None
    reqs = _run_p2pops(send_prev, send_next, tensor_recv_prev, tensor_recv_next, async_comm, batch_p2p_comm)
    if overlap_p2p_comm:
        return tensor_recv_prev, tensor_recv_next, reqs
    for req in reqs:
        req.wait()
    if async_comm:
        # Deferring the waits to FutureTensor.get() timed out in the interleaved schedule on Gloo (4 ranks), so
        # the exchange completes here and async_comm only changes the return type.
        return (
            None if tensor_recv_prev is None else FutureTensor(tensor_recv_prev, None),
            None if tensor_recv_next is None else FutureTensor(tensor_recv_next, None),
            None,
        )
    if sync_batch_comm and any(t is not None and t.is_cuda
                               for t in (send_next, send_prev, tensor_recv_prev, tensor_recv_next)):
        torch.cuda.synchronize()
    return tensor_recv_prev, tensor_recv_next, None


def _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm) -> dict:
    return dict(
        dtype_=dtype,
        async_comm=async_comm,
        sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm,
        batch_p2p_comm=batch_p2p_comm,
    )


def recv_forward(
    tensor_shape: Shape,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> torch.Tensor | FutureTensor | None:
    """Receive the previous stage's activation (None on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    return _communicate(None, None, True, False, tensor_shape, **kw)[0]


def recv_backward(
    tensor_shape: Shape = None,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> torch.Tensor | FutureTensor | None:
    """Receive the gradient of this stage's output from the next stage (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    return _communicate(None, None, False, True, tensor_shape, **kw)[1]


def send_forward(
    output_tensor: torch.Tensor,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    tensor_shape: Shape = None,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> None:
    """Send this stage's activation to the next stage (no-op on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    _communicate(output_tensor, None, False, False, tensor_shape, **kw)


def send_backward(
    input_tensor_grad: torch.Tensor,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    _communicate(None, input_tensor_grad, False, False, tensor_shape, **kw)


def send_forward_recv_backward(
    output_tensor: torch.Tensor,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> torch.Tensor | FutureTensor | None:
    """Send the activation forward and receive the output gradient back (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    return _communicate(output_tensor, None, False, True, tensor_shape, **kw)[1]


def send_backward_recv_forward(
    input_tensor_grad: torch.Tensor,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> torch.Tensor | FutureTensor | None:
    """Send the input gradient back and receive the next activation (None on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    return _communicate(None, input_tensor_grad, True, False, tensor_shape, **kw)[0]


def send_forward_recv_forward(
    output_tensor: torch.Tensor,
    recv_prev: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> torch.Tensor | FutureTensor:
    """Send the activation to the next stage and (if ``recv_prev``) receive one from the previous stage."""
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    recv, _, handles = _communicate(output_tensor, None, recv_prev, False, tensor_shape,
                                    overlap_p2p_comm=overlap_p2p_comm, **kw)
    return (recv, handles) if overlap_p2p_comm else recv


def send_backward_recv_backward(
    input_tensor_grad: torch.Tensor,
    recv_next: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> torch.Tensor | FutureTensor:
    """Send the input gradient to the previous stage and (if ``recv_next``) receive one from the next stage."""
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    _, recv, handles = _communicate(None, input_tensor_grad, False, recv_next, tensor_shape,
                                    overlap_p2p_comm=overlap_p2p_comm, **kw)
    return (recv, handles) if overlap_p2p_comm else recv


def send_forward_backward_recv_forward_backward(
    output_tensor: torch.Tensor,
    input_tensor_grad: torch.Tensor,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
    timers: _Timers = None,
) -> tuple[torch.Tensor | FutureTensor, torch.Tensor | FutureTensor]:
    """Both directions at once: returns ``(input_tensor, output_tensor_grad)``."""
    kw = _kw(dtype, async_comm, sequence_parallel_enabled, sync_batch_comm, batch_p2p_comm)
    prev, nxt, handles = _communicate(output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape,
                                      overlap_p2p_comm=overlap_p2p_comm, **kw)
    return (prev, nxt, handles) if overlap_p2p_comm else (prev, nxt)
