"""``DistributedFusedLAMB``'s checkpoints: every rank saves and loads its own shard (upstream's keys
``step``, ``fp32_p``, ``fp32_m``, ``fp32_v``), with the layout the shard belongs to, so that a checkpoint of a
different world size or layout is refused instead of silently mis-assigning elements."""

from __future__ import annotations

import torch

_SHARDS = ("fp32_p", "fp32_m", "fp32_v")


def _layout_of(opt) -> dict:
    lay = opt._layout
    return {"world_size": opt._world_size, "group_size": opt._group_size, "total": lay.total,
            "shard_numel": lay.shard_numel, "num_blocks": lay.num_blocks, "num_chunks": lay.num_chunks}


def shard_state_dict(opt) -> dict:
    """Copies of this rank's master weights and moments, the step count, the layout and the groups'
    hyper-parameters."""
    out = {"step": torch.tensor([opt._step], dtype=torch.int32)}
    for key in _SHARDS:
        out[key] = getattr(opt, "_" + key).clone()
    out["layout"] = _layout_of(opt)
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


@torch.no_grad()
def load_shard_state_dict(opt, state_dict: dict) -> None:
    """Check everything, then copy (a ``ValueError`` leaves the optimizer as it was)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    for key in ("step", *_SHARDS):
        if key not in state_dict:
            raise ValueError(f"state_dict has no {key!r}: not a DistributedFusedLAMB state_dict")
    saved, mine = state_dict.get("layout"), _layout_of(opt)
    if saved is not None and saved != mine:
        raise ValueError(f"the checkpoint's layout {saved} differs from this optimizer's {mine}; re-sharding a "
                         "DistributedFusedLAMB checkpoint to another world size or layout is not supported")
    for key in _SHARDS:
        t = state_dict[key]
        if not isinstance(t, torch.Tensor) or t.numel() != mine["shard_numel"]:
            raise ValueError(f"state_dict[{key!r}] must be a tensor of this rank's shard size "
                             f"{mine['shard_numel']}")
    groups = state_dict.get("param_groups")
    if groups is not None and len(groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer {len(opt.param_groups)}")
    for key in _SHARDS:
        getattr(opt, "_" + key).copy_(state_dict[key].reshape(-1))
    opt._step = int(torch.as_tensor(state_dict["step"]).reshape(-1)[0])
    for group, saved_group in zip(opt.param_groups, groups or ()):
        group.update(saved_group)
