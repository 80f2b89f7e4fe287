"""fp32 master weights for fp16 *and* bf16 parameters, kept in the per-parameter state (``master_param``) so that
they are saved by ``state_dict()`` and a resumed run continues bit for bit; Apex's ``param_groups_master`` points at
them."""

from __future__ import annotations

import torch

REDUCED = (torch.float16, torch.bfloat16)


class MasterWeights:
    """The master-weight part of :class:`apex.optimizers._base.FusedOptimizerBase` (which sets
    ``master_weights``; ``state`` and ``param_groups`` are ``torch.optim.Optimizer``'s)."""

    def _init_masters(self) -> None:
        """Apex's ``param_groups_master``: for each group, ``{"params": [its parameters' masters]}`` (fp32
        copies of fp16/bf16 parameters; an fp32 parameter is its own master; all None without master
        weights)."""
        self._pending_masters: dict = {}
        self.param_groups_master = [self._group_masters(g) for g in self.param_groups]

    def _group_masters(self, group: dict) -> dict:
        return {"params": [self._new_master(p) for p in group["params"]]}

    def _new_master(self, p: torch.Tensor) -> torch.Tensor | None:
        if not self.master_weights:
            return None
        if p.dtype not in REDUCED:
            return p
        m = p.detach().to(torch.float32, copy=True)
        self._remember_master(p, m)
        return m

    def _remember_master(self, p: torch.Tensor, m: torch.Tensor) -> None:
        # Until the first step adopts the master, the version counters tell whether the parameter (weights
        # loaded into the model) or the master (set by the user) was written in between.
        self._pending_masters[id(p)] = (m, p._version, m._version)

    def _rebuild_pending_masters(self) -> None:
        """After unpickling: the masters not yet adopted by a step are pending again (keyed by the new
        parameters, with the versions they have now)."""
        self._pending_masters = {}
        for group, masters in zip(self.param_groups, getattr(self, "param_groups_master", [])):
            for p, m in zip(group["params"], masters["params"]):
                if m is not None and m is not p and "master_param" not in self.state.get(p, {}):
                    self._remember_master(p, m)

    def _master(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master copy of a reduced-precision parameter (kept in the state as ``master_param``
        from the first step on), else None."""
        if not self.master_weights or p.dtype not in REDUCED:
            return None
        state = self.state[p]
        m = state.get("master_param")
        if m is None or m.shape != p.shape or m.device != p.device:
            m = state["master_param"] = self._adopt_master(p)
        return m

    def _adopt_master(self, p: torch.Tensor) -> torch.Tensor:
        """The master made at construction, refreshed from the parameter if that was written in place since
        (weights loaded into the model) and the master was not; else a new copy of the parameter (then
        ``param_groups_master`` is updated). A write through ``.data`` moves no version counter: such a
        write to the master keeps it, as Apex always keeps it."""
        pending = getattr(self, "_pending_masters", {}).pop(id(p), None)
        if pending is not None:
            m, p_version, m_version = pending
            if m.shape == p.shape and m.device == p.device:
                if p._version != p_version and m._version == m_version:
                    m.copy_(p)
                return m
        self._masters_stale = True
        return p.detach().to(torch.float32, copy=True)

    def _sync_masters(self) -> None:
        """Point ``param_groups_master`` at the state's masters (after a load, or a master made anew)."""
        self._masters_stale = False
        if not hasattr(self, "param_groups_master"):
            return
        rows = []
        for gi, group in enumerate(self.param_groups):
            old = self.param_groups_master[gi]["params"] if gi < len(self.param_groups_master) else []
            row = []
            for pi, p in enumerate(group["params"]):
                st = self.state.get(p)
                m = st.get("master_param") if st else None
                if m is not None and self.master_weights and p.dtype in REDUCED:
                    getattr(self, "_pending_masters", {}).pop(id(p), None)
                elif pi < len(old) and (old[pi] is None) == (not self.master_weights):
                    m = old[pi]
                else:
                    m = self._new_master(p)
                row.append(m)
            rows.append({"params": row})
        self.param_groups_master = rows
