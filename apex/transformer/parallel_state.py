"""Model-parallel process groups (Megatron-LM's ``mpu``): tensor, pipeline, data, model, embedding,
position-embedding, relative-position and amax groups, on any ``torch.distributed`` backend.

The layout is Megatron's: with world size W, tensor size T and pipeline size P (D = W / (T*P)), a
tensor group is T consecutive ranks, a pipeline group is the P ranks ``i, i + W/P, ...``, a data group
is the D ranks with stride T inside one pipeline stage's block of W/P ranks. :func:`group_layout`
computes it without any process group, so it can be checked for any world size.

All state lives in one :class:`_ParallelState` object; the module-level functions are accessors over it.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from apex._errors import AssertTypeError, ParallelStateError
from apex.transformer._group_layout import GroupLayout, group_layout  # noqa: F401 - GroupLayout re-exported
from apex.transformer._ucc_util import HAS_UCC
from apex.transformer.log_util import get_transformer_logger

_logger = get_transformer_logger(__name__)


class ExperimentalWarning(Warning):
    """Warned when the experimental UCC backend is requested."""


@dataclass
class _ParallelState:
    tensor_group: Any = None
    pipeline_group: Any = None
    model_group: Any = None
    data_group: Any = None
    amax_group: Any = None
    embedding_group: Any = None
    position_embedding_group: Any = None
    encoder_relative_position_embedding_group: Any = None
    decoder_relative_position_embedding_group: Any = None
    embedding_ranks: list | None = None
    position_embedding_ranks: list | None = None
    encoder_relative_position_embedding_ranks: list | None = None
    decoder_relative_position_embedding_ranks: list | None = None
    pipeline_ranks: list | None = None
    data_ranks: list | None = None
    virtual_pipeline_rank: int | None = None
    virtual_pipeline_world_size: int | None = None
    pipeline_split_rank: int | None = None
    # Overrides set by set_*_world_size / set_*_rank (Megatron changes the mpu sizes on the fly).
    mpu_tensor_world_size: int | None = None
    mpu_pipeline_world_size: int | None = None
    mpu_tensor_rank: int | None = None
    mpu_pipeline_rank: int | None = None

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, None)


_STATE = _ParallelState()

# Apex kept this state in module globals, which client code reads (and some sets) by name, e.g.
# ``parallel_state._DATA_PARALLEL_GROUP``: each name reads and writes its field of ``_STATE``.
_APEX_GLOBALS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tensor_group", "_PIPELINE_MODEL_PARALLEL_GROUP": "pipeline_group",
    "_MODEL_PARALLEL_GROUP": "model_group", "_DATA_PARALLEL_GROUP": "data_group",
    "_AMAX_REDUCTION_GROUP": "amax_group", "_EMBEDDING_GROUP": "embedding_group",
    "_POSITION_EMBEDDING_GROUP": "position_embedding_group",
    "_ENCODER_RELATIVE_POSITION_EMBEDDING_GROUP": "encoder_relative_position_embedding_group",
    "_DECODER_RELATIVE_POSITION_EMBEDDING_GROUP": "decoder_relative_position_embedding_group",
    "_EMBEDDING_GLOBAL_RANKS": "embedding_ranks", "_POSITION_EMBEDDING_GLOBAL_RANKS": "position_embedding_ranks",
    "_ENCODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS": "encoder_relative_position_embedding_ranks",
    "_DECODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS": "decoder_relative_position_embedding_ranks",
    "_PIPELINE_GLOBAL_RANKS": "pipeline_ranks",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": "virtual_pipeline_rank",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "virtual_pipeline_world_size",
    "_PIPELINE_MODEL_PARALLEL_SPLIT_RANK": "pipeline_split_rank",
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": "mpu_tensor_world_size",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "mpu_pipeline_world_size",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK": "mpu_tensor_rank", "_MPU_PIPELINE_MODEL_PARALLEL_RANK": "mpu_pipeline_rank",
}


def __getattr__(name: str) -> Any:
    field = _APEX_GLOBALS.get(name)
    if field is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_STATE, field)


class _Module(types.ModuleType):
    """Routes assignments to Apex's global names into ``_STATE`` (a plain module attribute would shadow it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        field = _APEX_GLOBALS.get(name)
        if field is None:
            super().__setattr__(name, value)
        else:
            setattr(_STATE, field, value)

    def __delattr__(self, name: str) -> None:
        if name in _APEX_GLOBALS:  # monkeypatch's undo of a name the module never held
            setattr(_STATE, _APEX_GLOBALS[name], None)
        else:
            super().__delattr__(name)


sys.modules[__name__].__class__ = _Module


def _require(value: Any, what: str) -> Any:
    if value is None:
        raise ParallelStateError(f"{what} is not initialized; call apex.transformer.parallel_state."
                                 "initialize_model_parallel() first")
    return value


# ----------------------------------------------------------------------------------- process groups
def set_nccl_socket_envs() -> None:
    """Select NCCL's socket transport (``NCCL_NET=Socket``); ``RuntimeError`` without ``NCCL_SOCKET_IFNAME``."""
    if os.getenv("NCCL_SOCKET_IFNAME") is None:
        raise RuntimeError("NCCL_SOCKET_IFNAME was not set")
    os.environ["NCCL_NET"] = "Socket"


def set_nccl_ib_envs() -> None:
    """Select NCCL's InfiniBand transport (``NCCL_NET=IB``)."""
    os.environ["NCCL_NET"] = "IB"


def init_nccl_net(group) -> None:
    """Run one all-reduce on ``group`` so NCCL builds its communicator under the current NCCL_NET."""
    temp = torch.ones(1, device="cuda")
    dist.all_reduce(temp, group=group)
    torch.cuda.synchronize()


def new_nccl_socket_group(ranks):
    """A new NCCL group over ``ranks`` using the socket transport."""
    set_nccl_socket_envs()
    group = dist.new_group(ranks, backend="nccl", timeout=_default_group_timeout())
    init_nccl_net(group=group)
    return group


def new_nccl_ib_group(ranks):
    """A new NCCL group over ``ranks`` using the InfiniBand transport."""
    set_nccl_ib_envs()
    group = dist.new_group(ranks, backend="nccl", timeout=_default_group_timeout())
    init_nccl_net(group=group)
    return group


def _resolve_backend(backend: str | None) -> str:
    """The backend a group is built with: ``None`` means the default group's; NCCL without CUDA
    (a Gloo default group on CPUs) means the default group's as well, so GPU code runs anywhere."""
    default = str(dist.get_backend())
    if backend is None:
        return default
    backend = str(backend).lower()
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        return default
    return backend


def _default_group_timeout():
    """The default group's timeout, so a rank that dies fails the subgroups' collectives just as soon
    (``new_group`` would otherwise use torch's 10/30-minute default)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if torch.device("cuda") in group._device_types else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # private API of torch.distributed; None = torch's default
        return None


def new_process_group(ranks, backend: str | None):
    """Create a process group over ``ranks``; with NCCL and ``NUM_GPUS_PER_IB_BLOCK`` set, ranks in one
    InfiniBand block use ``NCCL_NET=IB`` and others ``NCCL_NET=Socket`` (Megatron's hybrid network)."""
    ranks = list(ranks)
    backend = _resolve_backend(backend)
    block = os.getenv("NUM_GPUS_PER_IB_BLOCK")
    if backend == "nccl" and block is not None:
        blocks = {r // int(block) for r in ranks}
        return new_nccl_ib_group(ranks) if len(blocks) == 1 else new_nccl_socket_group(ranks)
    return dist.new_group(ranks, backend=backend, timeout=_default_group_timeout())


def initialize_model_parallel(
    tensor_model_parallel_size_: int = 1,
    pipeline_model_parallel_size_: int = 1,
    virtual_pipeline_model_parallel_size_: int | None = None,
    pipeline_model_parallel_split_rank_: int | None = None,
    use_fp8_: bool = False,
    init_mpi_proc_group: bool = False,
    *,
    default_backend: str | None = None,
    p2p_backend: str | None = None,
) -> None:
    """Build Megatron's tensor, pipeline, data, model, embedding and amax groups over the world.

    ``default_backend`` (all groups but the pipeline ones) and ``p2p_backend`` (pipeline, embedding)
    default to the backend of the default process group; "nccl" on a machine without CUDA uses it too.
    Sizes larger than the world are clipped to it, as upstream does.
    """
    if not dist.is_initialized():
        raise ParallelStateError("torch.distributed is not initialized; call init_process_group first")
    if model_parallel_is_initialized() or _STATE.data_group is not None:
        raise ParallelStateError("model parallel groups are already initialized; call destroy_model_parallel first")
    for name, value in (("tensor_model_parallel_size_", tensor_model_parallel_size_),
                        ("pipeline_model_parallel_size_", pipeline_model_parallel_size_)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("default_backend", default_backend), ("p2p_backend", p2p_backend)):
        if value is not None and not isinstance(value, str):
            raise AssertTypeError(f"{name} must be a backend name or None, got {value!r}")
    if "ucc" in (default_backend, p2p_backend):
        if not HAS_UCC:
            raise ImportError("UCC backend requires pytorch source build with UCC installed and enabled")
        warnings.warn("`ucc` backend support is experimental", ExperimentalWarning, stacklevel=2)

    world_size = dist.get_world_size()
    rank = dist.get_rank()
    tp = min(tensor_model_parallel_size_, world_size)
    pp = min(pipeline_model_parallel_size_, world_size)
    if virtual_pipeline_model_parallel_size_ is not None and pipeline_model_parallel_size_ <= 2:
        # Inherited from Megatron-LM: the interleaved schedule needs more than two stages.
        raise ParallelStateError("pipeline-model-parallel size should be greater than 2 with interleaved schedule, "
                                 f"got {pipeline_model_parallel_size_}")
    if pipeline_model_parallel_split_rank_ is not None and not 0 <= pipeline_model_parallel_split_rank_ < pp:
        raise ValueError(f"pipeline_model_parallel_split_rank_ must be in [0, {pp}), "
                         f"got {pipeline_model_parallel_split_rank_}")
    layout = group_layout(world_size, tp, pp, pipeline_model_parallel_split_rank_, use_fp8_)
    if rank == 0:
        _logger.info("> initializing tensor model parallel with size %d", tp)
        _logger.info("> initializing pipeline model parallel with size %d", pp)
        _logger.info("> initializing data parallel with size %d", world_size // (tp * pp))

    saved_nccl_net = os.getenv("NCCL_NET")
    s = _STATE
    if virtual_pipeline_model_parallel_size_ is not None:
        s.virtual_pipeline_rank = 0
        s.virtual_pipeline_world_size = virtual_pipeline_model_parallel_size_
    s.pipeline_split_rank = pipeline_model_parallel_split_rank_

    # Every rank must create every group, in the same order (torch.distributed.new_group is collective).
    for ranks in layout.data:
        group = new_process_group(ranks, default_backend)
        if rank in ranks:
            s.data_group, s.data_ranks = group, ranks
    for ranks in layout.amax:
        group = new_process_group(ranks, default_backend)
        if rank in ranks:
            s.amax_group = group
    for ranks in layout.model:
        group = new_process_group(ranks, default_backend)
        if rank in ranks:
            s.model_group = group
    for ranks in layout.tensor:
        group = new_process_group(ranks, default_backend)
        if rank in ranks:
            s.tensor_group = group
    for i, ranks in enumerate(layout.pipeline):
        group = new_process_group(ranks, p2p_backend)
        mine = rank in ranks
        if mine:
            s.pipeline_group, s.pipeline_ranks = group, ranks
        for kind in ("embedding", "position_embedding", "encoder_relative_position_embedding",
                     "decoder_relative_position_embedding"):
            members = getattr(layout, kind)[i]
            if not members:  # a split at rank 0 leaves the encoder side empty
                if mine:
                    setattr(s, f"{kind}_ranks", members)
                continue
            group = new_process_group(members, p2p_backend)
            if rank in members:
                setattr(s, f"{kind}_group", group)
            if mine:
                setattr(s, f"{kind}_ranks", members)

    if init_mpi_proc_group:
        dist.new_group(backend="mpi")
    if saved_nccl_net is None:
        os.environ.pop("NCCL_NET", None)
    else:
        os.environ["NCCL_NET"] = saved_nccl_net


def destroy_model_parallel() -> None:
    """Forget every group and override (the groups themselves stay with torch.distributed)."""
    _STATE.reset()


def is_unitialized() -> bool:
    """Useful for code that may run with or without model-parallel initialization."""
    return _STATE.data_group is None


def model_parallel_is_initialized() -> bool:
    """True once ``initialize_model_parallel`` has built the tensor, pipeline and data groups."""
    return None not in (_STATE.tensor_group, _STATE.pipeline_group, _STATE.data_group)


# ------------------------------------------------------------------------------------------ getters
def get_rank_info() -> tuple[int, int, int, int | None]:
    """(data, tensor, pipeline, virtual pipeline)-parallel ranks, for the logger."""
    if model_parallel_is_initialized():
        return (get_data_parallel_rank(), get_tensor_model_parallel_rank(), get_pipeline_model_parallel_rank(),
                get_virtual_pipeline_model_parallel_rank())
    return (0, 0, 0, 0)


def get_model_parallel_group():
    """The model-parallel (tensor × pipeline) group of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.model_group, "model parallel group")


def get_tensor_model_parallel_group():
    """The tensor-parallel group of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.tensor_group, "tensor model parallel group")


def get_pipeline_model_parallel_group():
    """The pipeline-parallel group of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.pipeline_group, "pipeline model parallel group")


def get_data_parallel_group():
    """The data-parallel group of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.data_group, "data parallel group")


def get_amax_reduction_group():
    """The FP8 amax-reduction group (needs ``use_fp8_=True``) of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.amax_group, "AMAX reduction group (initialize_model_parallel(use_fp8_=True))")


def get_embedding_group():
    """The embedding group (first and last pipeline stages, tied word embeddings) of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.embedding_group, "embedding group")


def get_position_embedding_group():
    """The position-embedding group of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.position_embedding_group, "position embedding group")


def get_encoder_relative_position_embedding_group():
    """The encoder relative-position-embedding group of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.encoder_relative_position_embedding_group, "encoder relative position embedding group")


def get_decoder_relative_position_embedding_group():
    """The decoder relative-position-embedding group of this rank.

    Raises :class:`ParallelStateError` before ``initialize_model_parallel``.
    """
    return _require(_STATE.decoder_relative_position_embedding_group, "decoder relative position embedding group")


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """True if this rank holds tied word embeddings (with ``ignore_virtual=False``, only on the
    first or last virtual stage).
    """
    rank = dist.get_rank()
    ranks = _require(_STATE.embedding_ranks, "embedding group")
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """True if this rank is in the position-embedding group."""
    return dist.get_rank() in _require(_STATE.position_embedding_ranks, "position embedding group")


def is_rank_in_encoder_relative_position_embedding_group() -> bool:
    """True if this rank is in the encoder relative-position-embedding group."""
    ranks = _require(_STATE.encoder_relative_position_embedding_ranks, "encoder relative position embedding group")
    return dist.get_rank() in ranks


def is_rank_in_decoder_relative_position_embedding_group() -> bool:
    """True if this rank is in the decoder relative-position-embedding group."""
    ranks = _require(_STATE.decoder_relative_position_embedding_ranks, "decoder relative position embedding group")
    return dist.get_rank() in ranks


def is_pipeline_stage_before_split(rank: int | None = None) -> bool:
    """True if the stage runs the encoder of an encoder-and-decoder model (always without a split)."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    split = _STATE.pipeline_split_rank
    return split is None or rank < split


def is_pipeline_stage_after_split(rank: int | None = None) -> bool:
    """True if the stage runs the decoder of an encoder-and-decoder model (always without a split)."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    split = _STATE.pipeline_split_rank
    return split is None or rank >= split


def is_pipeline_stage_at_split() -> bool:
    """True if this stage runs the encoder and the next one the decoder."""
    rank = get_pipeline_model_parallel_rank()
    return is_pipeline_stage_before_split(rank) and is_pipeline_stage_after_split(rank + 1)


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the tensor-parallel size the getters report (None: ask the group)."""
    _STATE.mpu_tensor_world_size = world_size


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline-parallel size the getters report (None: ask the group)."""
    _STATE.mpu_pipeline_world_size = world_size


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor-parallel rank the getters report (None: ask the group)."""
    _STATE.mpu_tensor_rank = rank


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline-parallel rank the getters report (None: ask the group)."""
    _STATE.mpu_pipeline_rank = rank


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel size (the override if set)."""
    if _STATE.mpu_tensor_world_size is not None:
        return _STATE.mpu_tensor_world_size
    return dist.get_world_size(group=get_tensor_model_parallel_group())


def get_pipeline_model_parallel_world_size() -> int:
    """The pipeline-parallel size (the override if set)."""
    if _STATE.mpu_pipeline_world_size is not None:
        return _STATE.mpu_pipeline_world_size
    return dist.get_world_size(group=get_pipeline_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group (the override if set)."""
    if _STATE.mpu_tensor_rank is not None:
        return _STATE.mpu_tensor_rank
    return dist.get_rank(group=get_tensor_model_parallel_group())


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage (the override if set)."""
    if _STATE.mpu_pipeline_rank is not None:
        return _STATE.mpu_pipeline_rank
    return dist.get_rank(group=get_pipeline_model_parallel_group())


def get_pipeline_model_parallel_split_rank() -> int | None:
    """The first decoder stage of an encoder-and-decoder pipeline, or None."""
    return _STATE.pipeline_split_rank


def set_pipeline_model_parallel_split_rank(pipeline_model_parallel_split_rank: int | None) -> None:
    """Set the first decoder stage of an encoder-and-decoder pipeline."""
    _STATE.pipeline_split_rank = pipeline_model_parallel_split_rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the first pipeline stage (and, unless ``ignore_virtual``, the first virtual chunk)."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None \
            and get_virtual_pipeline_model_parallel_rank() != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last pipeline stage (and, unless ``ignore_virtual``, the last virtual chunk)."""
    vsize = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vsize is not None and get_virtual_pipeline_model_parallel_rank() != vsize - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The current virtual pipeline chunk, or None without interleaving."""
    return _STATE.virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Set the current virtual pipeline chunk."""
    _STATE.virtual_pipeline_rank = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """The number of virtual pipeline chunks per stage, or None."""
    return _STATE.virtual_pipeline_world_size


def set_virtual_pipeline_model_parallel_world_size(size: int | None) -> None:
    """Set the number of virtual pipeline chunks per stage."""
    _STATE.virtual_pipeline_world_size = size


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first member of this rank's tensor group."""
    size = get_tensor_model_parallel_world_size()
    return (dist.get_rank() // size) * size


def get_data_parallel_src_rank() -> int:
    """Global rank of the first member of this rank's data-parallel group (upstream's
    ``rank % (world / dp)`` formula, which is wrong once the pipeline size exceeds 1, is not used)."""
    return _require(_STATE.data_ranks, "data parallel group")[0]


def _pipeline_ranks() -> list:
    return _require(_STATE.pipeline_ranks, "pipeline parallel group")


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of this rank's pipeline."""
    return _pipeline_ranks()[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this rank's pipeline."""
    return _pipeline_ranks()[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wrapping around)."""
    ranks = _pipeline_ranks()
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wrapping around)."""
    ranks = _pipeline_ranks()
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


def get_data_parallel_world_size() -> int:
    """The size of this rank's data-parallel group."""
    return dist.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    """This rank's index in its data-parallel group."""
    return dist.get_rank(group=get_data_parallel_group())
