"""The set-up of :class:`~apex.contrib.optimizers.distributed_fused_lamb.DistributedFusedLAMB`, done once in its
constructor: the sharding process groups, the parameters' checks and broadcast, the flat gradient buffer and the
fp32 shard buffers (master weights, moments, scratch), and the fragment views and norm indices every step reuses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex._kernels._lists import column
from apex.contrib.optimizers._dist_lamb_layout import Layout, shard_groups
from apex.contrib.optimizers._gloo_collectives import takes_gloo_path
from apex.ops._cpu_blocks import Workspace

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Setup:
    """``DistributedFusedLAMB``'s set-up methods (a base class of it; they read and set its attributes)."""

    def _setup_groups(self, dwu_group_size: int) -> None:
        self._world_size = dist.get_world_size()
        self._group_size, self._rs_pg, self._ar_pg = shard_groups(dwu_group_size)
        self._num_groups = self._world_size // self._group_size
        self._rank_in_group = dist.get_rank() % self._group_size

    @torch.no_grad()
    def _setup_params(self) -> None:
        params, groups = [], []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.dtype not in _DTYPES:
                    raise TypeError(f"DistributedFusedLAMB supports {_DTYPES} parameters, got {p.dtype}")
                if p.requires_grad:
                    params.append(p)
                    groups.append(gi)
        if not params:
            raise ValueError("DistributedFusedLAMB got no parameter that requires grad")
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError("DistributedFusedLAMB needs all parameters on one device, got "
                             f"{sorted({str(p.device) for p in params})}")
        backend = str(dist.get_backend(self._rs_pg))
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"the process group's backend is NCCL but the parameters are on {device}")
        self._device = device
        for group in self.param_groups:  # the same starting point on every rank, as upstream
            for p in group["params"]:
                dist.broadcast(p.data, src=0)
        dtypes = {p.dtype for p in params}
        self._flat_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self._model_params, self._param_group_index = params, groups
        self._layout = lay = Layout([p.numel() for p in params], self._group_size, self._rank_in_group,
                                    self._num_blocks, self._num_chunks)
        kw = dict(device=device)
        self._flat_grads = torch.zeros(lay.padded, dtype=self._flat_dtype, **kw)
        self._grad_views = [self._flat_grads[o:o + p.numel()].view(p.shape) for o, p in zip(lay.offsets, params)]
        self._fp16_g = torch.zeros(lay.shard_numel, dtype=self._flat_dtype, **kw)  # reduced gradient shard
        self._fp32_p = torch.zeros(lay.shard_numel, dtype=torch.float32, **kw)
        self._fp32_m = torch.zeros_like(self._fp32_p)
        self._fp32_v = torch.zeros_like(self._fp32_p)
        self._fp32_u = torch.zeros_like(self._fp32_p)  # update direction (scratch)
        self._fp32_g = torch.zeros_like(self._fp32_p)  # unscaled, clipped gradient (scratch)
        self._fp16_p = torch.zeros(lay.shard_numel, dtype=self._flat_dtype, **kw)  # all-gather input
        self._new_params = torch.zeros(lay.padded, dtype=self._flat_dtype, **kw)  # all-gather output
        # Gloo's reduce-scatter (_gloo_collectives) receives the peers' chunks here rather than in a fresh
        # buffer every step (page faults on the CPU); NCCL reduces in place and needs none.
        self._gather_segments = lay.gather_segments()
        self._segment_views = None  # (params' data pointers, their segment views, the gathered ones)
        self._rs_scratch = (torch.empty(lay.padded, dtype=self._flat_dtype, **kw)
                            if takes_gloo_path(self._rs_pg) else None)
        self._frag_group = []
        n = len(params)
        for f in lay.fragments:
            src = params[f.param].detach().reshape(-1)[f.param_offset:f.param_offset + f.length]
            self._fp32_p[f.shard_offset:f.shard_offset + f.length].copy_(src)
            self._frag_group.append(groups[f.param])
        # per param group: the shard's fragment views and the parameters they belong to
        self._group_frags = []
        for gi in range(len(self.param_groups)):
            sel = [f for f, g in zip(lay.fragments, self._frag_group) if g == gi]
            # Columns: the step hands the same fragment views to the multi-tensor ops every time, their
            # addresses and sizes read once here (the shard buffers live as long as the optimizer)
            views = [column([t[f.shard_offset:f.shard_offset + f.length] for f in sel])
                     for t in (self._fp32_g, self._fp32_p, self._fp32_m, self._fp32_v, self._fp32_u)]
            self._group_frags.append((torch.tensor([f.param for f in sel], dtype=torch.long, device=device),
                                      views))
        # The weight decay (decoupled: u += wd * p; L2: g += wd * p) is elementwise, so it runs over the group's
        # runs of fragments that are neighbours in the shard (one run for a model of one group): an op per
        # fragment cost a microsecond per parameter on the host.
        self._group_runs = []
        for gi in range(len(self.param_groups)):
            runs: list = []
            for f, g in zip(lay.fragments, self._frag_group):
                if g != gi or f.length == 0:
                    continue
                if runs and runs[-1][1] == f.shard_offset:
                    runs[-1][1] += f.length
                else:
                    runs.append([f.shard_offset, f.shard_offset + f.length])
            self._group_runs.append(tuple([t[a:b] for a, b in runs] for t in (self._fp32_g, self._fp32_p,
                                                                                  self._fp32_u)))
        # the CPU LAMB path's buffers, reused every step (building them per step allocates a shard's worth)
        self._lamb_workspaces = [Workspace([t.shape for t in views[4]]) if device.type == "cpu" and views[4]
                                 else None for _, views in self._group_frags]
        self._frags_pu = column([t for _, views in self._group_frags for t in views[1]]
                                + [t for _, views in self._group_frags for t in views[4]])
        idx = [int(i) for gidx, _ in self._group_frags for i in gidx]  # the order _update lists fragments in
        self._norm_index = torch.tensor(idx + [i + n for i in idx], dtype=torch.long, device=device)
        # each group's places of its update norms (after the n parameter norms): kept, not added every step
        self._group_u_index = [gidx + n for gidx, _ in self._group_frags]
        self._overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self._copy_flag = torch.zeros(1, dtype=torch.int32, device=device)  # the copies' (unread) inf flag
        # a gradient of the flat buffer's dtype is queued by its hook (torch.mul into another dtype rounds
        # to the gradient's dtype first: those are taken one by one, as before)
        self._queueable = [p.dtype == self._flat_dtype for p in params]
        self._norm_sq = torch.zeros(2 * n, dtype=torch.float32, device=device)
        self._zero_norm = torch.zeros(1, device=device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]
        if self._verbose and dist.get_rank() == 0:
            print(f"DistributedFusedLAMB: {n} parameters, {lay.total} elements padded to {lay.padded}; "
                  f"{lay.pieces} pieces of {lay.piece} per rank over {self._group_size} ranks x "
                  f"{self._num_groups} groups; gradients in {self._flat_dtype}")
