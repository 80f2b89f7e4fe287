"""Model-parallel RNG: named generator states forked around tensor-parallel work (dropout inside a
tensor-parallel region, weight initialisation), and activation checkpointing that replays them.

The tracked generator is CUDA's default generator when CUDA is available, else the CPU's default
generator, so dropout and initialisation on a CPU machine fork and replay exactly as on a GPU.
"""

from __future__ import annotations

import contextlib

import torch

from apex._errors import AssertRuntimeError, AssertValueError
from apex.transformer.parallel_state import get_tensor_model_parallel_rank
from apex.transformer.tensor_parallel.memory import allocate_mem_buff
from apex.transformer.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "get_cuda_rng_tracker",
    "init_checkpointed_activations_memory_buffer",
    "model_parallel_cuda_manual_seed",
    "reset_checkpointed_activations_memory_buffer",
]

# Default name for the model parallel rng tracker.
_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _on_cuda() -> bool:
    return torch.cuda.is_available()


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _on_cuda() else torch.get_rng_state()


def _manual_seed(seed: int) -> None:
    if _on_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def _set_cuda_rng_state(new_state: torch.Tensor, device: int | str | torch.device = -1) -> None:
    """Set the tracked generator's state without cloning ``new_state`` (cloning was slow upstream)."""
    if not _on_cuda():
        torch.default_generator.set_state(new_state)
        return
    if device == -1:
        device = torch.device("cuda")
    elif isinstance(device, (str, int)):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)

    def cb():
        idx = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[idx].set_state(new_state)

    torch.cuda._lazy_call(cb)


class CudaRNGStatesTracker:
    """Named RNG states: :meth:`add` seeds one, :meth:`fork` runs a block with it and keeps its advance,
    restoring the ambient state afterwards."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A shallow copy of the name -> state map."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_cuda_rng_state(orig)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig = _get_rng_state()
        _set_cuda_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_cuda_rng_state(orig)


class _Tracker:
    """Holder of the process-wide tracker (state in an object)."""

    tracker = CudaRNGStatesTracker()
    checkpointed_activations_buffer = None


def __getattr__(name: str):
    # Apex kept these as module globals, and client code reads them by name: the same objects as
    # ``get_cuda_rng_tracker()`` and the buffer ``init_checkpointed_activations_memory_buffer`` allocates.
    if name == "_CUDA_RNG_STATE_TRACKER":
        return _Tracker.tracker
    if name == "_CHECKPOINTED_ACTIVATIONS_MEMORY_BUFFER":
        return _Tracker.checkpointed_activations_buffer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's RNG-states tracker (Megatron's ``get_cuda_rng_tracker``; forks the CPU generator
    where there is no CUDA).
    """
    return _Tracker.tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` (same on all tensor-parallel ranks, for dropout outside
    tensor-parallel regions) and the tracker's model-parallel state with ``seed + 2718 + tp_rank``
    (different per tensor-parallel rank, same across data-parallel replicas)."""
    tensor_model_parallel_seed = seed + 2718 + get_tensor_model_parallel_rank()
    _Tracker.tracker.reset()
    _manual_seed(seed)
    _Tracker.tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)


def init_checkpointed_activations_memory_buffer(micro_batch_size, max_position_embeddings, hidden_size, num_layers,
                                                tensor_model_parallel_size, checkpoint_num_layers, fp16) -> None:
    """Allocate the buffer for distributed checkpointed activations (kept for API compatibility)."""
    per_layer = micro_batch_size * max_position_embeddings * hidden_size // tensor_model_parallel_size
    if num_layers % checkpoint_num_layers:
        raise AssertValueError(f"number of layers ({num_layers}) is not divisible by checkpoint-num-layers "
                         f"({checkpoint_num_layers})")
    if _Tracker.checkpointed_activations_buffer is not None:
        raise AssertRuntimeError("checkpointed activations memory buffer is already allocated.")
    _Tracker.checkpointed_activations_buffer = allocate_mem_buff(
        "checkpointed activations", per_layer * (num_layers // checkpoint_num_layers),
        torch.half if fp16 else torch.float, track_usage=False)


def reset_checkpointed_activations_memory_buffer() -> None:
    """Reset the buffer that holds distributed checkpointed activations, if one is allocated."""
    if _Tracker.checkpointed_activations_buffer is not None:
        _Tracker.checkpointed_activations_buffer.reset()


class CheckpointFunction(torch.autograd.Function):
    """``torch.utils.checkpoint`` that also saves and replays the tracker's states, so dropout inside a
    fork gives the same mask in the recomputation. With ``distribute_saved_activations`` the first
    argument is stored as this tensor-parallel rank's 1/TP slice and all-gathered for the backward."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.fwd_cpu_rng_state = torch.get_rng_state()
        ctx.fwd_cuda_rng_state = _get_rng_state()
        ctx.fwd_cuda_rng_state_tracker = get_cuda_rng_tracker().get_states()
        with torch.no_grad():
            outputs = run_function(*args)
        if distribute_saved_activations:
            ctx.input_0_shape = args[0].shape
            args = (split_tensor_into_1d_equal_chunks(args[0].detach()).clone(), *args[1:])
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
        inputs = list(ctx.saved_tensors)
        if ctx.distribute_saved_activations:
            inputs[0] = gather_split_1d_tensor(inputs[0]).view(ctx.input_0_shape)
        bwd_cpu_rng_state = torch.get_rng_state()
        bwd_cuda_rng_state = _get_rng_state()
        bwd_tracker_states = get_cuda_rng_tracker().get_states()
        torch.set_rng_state(ctx.fwd_cpu_rng_state)
        _set_cuda_rng_state(ctx.fwd_cuda_rng_state)
        get_cuda_rng_tracker().set_states(ctx.fwd_cuda_rng_state_tracker)
        # The distributed first input comes back gathered, without autograd history: mark what needs a grad.
        detached = tuple(x.detach().requires_grad_(need) if isinstance(x, torch.Tensor) else x
                         for x, need in zip(inputs, ctx.needs_input_grad[2:]))
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
        finally:
            torch.set_rng_state(bwd_cpu_rng_state)
            _set_cuda_rng_state(bwd_cuda_rng_state)
            get_cuda_rng_tracker().set_states(bwd_tracker_states)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if isinstance(x, torch.Tensor) else None for x in detached)


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Run ``function(*args)`` without keeping its activations; recompute them, with the same RNG
    states (default, CPU and tracker), in the backward."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
