"""The optional layer norm before attention (``include_norm_add=True``) shared by ``SelfMultiheadAttn`` and
``EncdecMultiheadAttn``, with Apex's parameter names so that its state_dicts load: ``impl="fast"`` holds
``lyr_nrm_gamma_weights`` / ``lyr_nrm_beta_weights``, ``impl="default"`` a ``FusedLayerNorm`` in ``lyr_nrm``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from apex.normalization.fused_layer_norm import FusedLayerNorm


class NormAdd:
    """Mixin for an ``nn.Module`` with ``embed_dim`` and ``include_norm_add`` set."""

    def _init_norm_add(self, embed_dim: int, include_norm_add: bool, impl: str) -> None:
        self.lyr_nrm = None
        if include_norm_add and impl == "fast":
            self.lyr_nrm_gamma_weights = Parameter(torch.empty(embed_dim))
            self.lyr_nrm_beta_weights = Parameter(torch.empty(embed_dim))
        else:
            self.lyr_nrm_gamma_weights = None
            self.lyr_nrm_beta_weights = None
            if include_norm_add:
                self.lyr_nrm = FusedLayerNorm(embed_dim)

    def _reset_norm_add(self) -> None:
        if self.include_norm_add:
            if self.lyr_nrm is None:
                nn.init.ones_(self.lyr_nrm_gamma_weights)
                nn.init.zeros_(self.lyr_nrm_beta_weights)
            else:
                self.lyr_nrm.reset_parameters()

    def _pre_norm(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` layer-normalised when ``include_norm_add``, else ``query`` itself."""
        if not self.include_norm_add:
            return query
        if self.lyr_nrm is None:
            return F.layer_norm(query, (self.embed_dim,), self.lyr_nrm_gamma_weights, self.lyr_nrm_beta_weights)
        return self.lyr_nrm(query)
