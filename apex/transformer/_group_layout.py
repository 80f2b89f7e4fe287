"""Megatron-LM's model-parallel group layout as a pure function of the world size (no process group)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GroupLayout:
    """Every rank list of Megatron's layout, in the order the groups are created."""

    data: list = field(default_factory=list)
    amax: list = field(default_factory=list)
    model: list = field(default_factory=list)
    tensor: list = field(default_factory=list)
    pipeline: list = field(default_factory=list)
    embedding: list = field(default_factory=list)
    position_embedding: list = field(default_factory=list)
    encoder_relative_position_embedding: list = field(default_factory=list)
    decoder_relative_position_embedding: list = field(default_factory=list)


def group_layout(world_size: int, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                 pipeline_model_parallel_split_rank: int | None = None, use_fp8: bool = False) -> GroupLayout:
    """Megatron's rank lists for a world of ``world_size`` ranks (sizes already clipped to the world).

    Entry ``i`` of ``pipeline`` and of the embedding lists belong together (one per pipeline group).
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise RuntimeError(
            f"`world_size` ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp})")
    dp = world_size // (tp * pp)
    n_pipeline_groups = world_size // pp
    out = GroupLayout()
    for i in range(pp):
        start, end = i * n_pipeline_groups, (i + 1) * n_pipeline_groups
        out.data.extend(list(range(start + j, end, tp)) for j in range(tp))
    if use_fp8:
        amax_size = tp * dp
        out.amax = [list(range(i * amax_size, (i + 1) * amax_size)) for i in range(world_size // amax_size)]
    out.model = [[ranks[i] for ranks in out.data] for i in range(dp)]
    out.tensor = [list(range(i * tp, (i + 1) * tp)) for i in range(world_size // tp)]
    split = pipeline_model_parallel_split_rank
    for i in range(n_pipeline_groups):
        ranks = list(range(i, world_size, n_pipeline_groups))
        out.pipeline.append(ranks)
        if len(ranks) > 1:
            emb, pos, enc, dec = [ranks[0], ranks[-1]], [ranks[0]], [ranks[0]], [ranks[0]]
            if split is not None:
                enc, dec = ranks[:split], ranks[split:]
                if ranks[split] not in emb:
                    emb = [ranks[0], ranks[split], ranks[-1]]
                if ranks[split] not in pos:
                    pos = [ranks[0], ranks[split]]
        else:
            emb, pos, enc, dec = ranks, ranks, ranks, ranks
        out.embedding.append(emb)
        out.position_embedding.append(pos)
        out.encoder_relative_position_embedding.append(enc)
        out.decoder_relative_position_embedding.append(dec)
    return out
