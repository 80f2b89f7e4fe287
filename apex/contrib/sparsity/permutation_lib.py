"""Model-level input-channel permutation for 2:4 sparsity (Apex's ``apex.contrib.sparsity.permutation_lib``).

Before masks are computed, ``Permutation.permute_model(model)`` re-orders channels so that 2:4 pruning keeps
more magnitude, without changing what the model computes: if a layer's input channels (weight columns, "C")
are permuted, the layers producing those channels permute their output rows, biases, and every tensor
indexed by the same channels ("K": norm parameters and running statistics, parameters added to the
activations, the other branch of a residual add or concatenation) the same way.

How: the model is traced with ``torch.fx``; :mod:`._permutation_graph` merges the channel spaces that must
share one order into groups (see there for the rules); for every permutable group with a sparse weight, the
sparse weights' columns (split into the group's period and stacked) are searched with
``accelerated_search_for_good_permutation`` and the permutation is applied in place (``tensor.data``, so
parameters keep their identity, their optimizer and their masks). A model that cannot be traced is left
unchanged (``permute_model`` returns False).

Differences from Apex: ``LocalResponseNorm`` mixes neighbouring channels and so blocks permutations (Apex
passes it through, changing the output slightly); transposes, slicing and unknown operations block the
channels they touch; BatchNorm running statistics are always permuted; the search is deterministic (the
seed functions are kept for Apex's API) and, when ``torch.distributed`` is initialised, rank 0's
permutations are broadcast so every rank applies the same; ``Permutation.search_options`` (a class
attribute, not in Apex) picks the search: the vectorised best-swap search ("channel swap") by default, which
is several times faster than the stripe-pair "exhaustive" search Apex uses (100 escape attempts on GPU
kernels) and finds optima of similar quality on random weights; set it to
``{"strategy": "exhaustive", "stripe_group_size": 8, "escape_attempts": 100}`` for Apex's choice.
"""

from __future__ import annotations

import json
import logging
import os
import random
import string
import time

import torch

from apex.contrib.sparsity._permutation_graph import analyse
from apex.contrib.sparsity.permutation_search_kernels import accelerated_search_for_good_permutation, sum_after_2_to_4

__all__ = ["Permutation", "convert_fx_node_name", "node_name_matches", "replicate_sequence"]

_log = logging.getLogger("apex.contrib.sparsity")


def convert_fx_node_name(fx_node_name: str) -> str:
    """Standardise a node's name: ``_`` becomes ``.``."""
    return fx_node_name.replace("_", ".")


def node_name_matches(node_name: str, module_name: str) -> bool:
    """Whether an fx node name and a module name denote the same module (ignoring punctuation, case and a
    DDP ``module.`` prefix)."""
    def squash(name):
        return "".join(c for c in name if c not in string.punctuation).lower()
    return module_name in (node_name, "module." + node_name) or squash(module_name) in (
        squash(node_name), "module" + squash(node_name))


def replicate_sequence(sequence, replications: int) -> list:
    """``sequence`` repeated ``replications`` times, each copy offset by ``len(sequence)`` (a tiled
    permutation for a tensor with a multiple of the permutation's channel count)."""
    n = len(sequence)
    return (torch.as_tensor(list(sequence), dtype=torch.long)[None, :]
            + n * torch.arange(replications)[:, None]).flatten().tolist()


class Permutation:
    """Class-level state and Apex's classmethod API (see the module docstring)."""

    _model = None
    _sparse_parameters: list = []
    _all_parameters: list = []
    _verbosity = 0
    _allow_permutation = False
    _save_permutation_graph = False
    _permutation_output_dir = "."
    _manual_seed = None
    _tcpstore_port = 2341
    _params_permuted_in_C: list = []
    _params_permuted_in_K: list = []
    _unpermuted_dims: list = []
    _applied: list = []  # (tensor, dim, index) of every permutation applied by the last permute_model
    search_options: dict = {"strategy": "channel swap"}

    @classmethod
    def _say(cls, level: int, msg: str) -> None:
        if cls._verbosity >= level:
            _log.info(msg)

    @classmethod
    def set_identical_seed(cls, identical_seed: int = 1) -> None:
        """Seed every RNG with ``identical_seed`` (Apex's way to make ranks agree; our search needs no RNG)."""
        cls._manual_seed = identical_seed
        cls.reset_seed()

    @classmethod
    def reset_seed(cls) -> None:
        if cls._manual_seed is None:
            raise RuntimeError("Must call set_identical_seed() before it can be reset")
        torch.manual_seed(cls._manual_seed)
        random.seed(cls._manual_seed)
        try:
            import numpy as np
        except ImportError:  # numpy is optional for apex
            return
        np.random.seed(cls._manual_seed)

    @classmethod
    def set_tcpstore_port(cls, tcpstore_port: int) -> None:
        """Kept for Apex's API: permutations are shared with ``torch.distributed`` collectives, not a store."""
        cls._tcpstore_port = int(tcpstore_port)

    @classmethod
    def set_permutation_saving_params(cls, allow_permutation: bool = False, save_permutation_graph: bool = False,
                                      permutation_output_dir: str = ".") -> None:
        cls._allow_permutation = allow_permutation
        cls._save_permutation_graph = save_permutation_graph
        cls._permutation_output_dir = permutation_output_dir

    @classmethod
    def set_permutation_params_from_asp(cls, model, sparse_parameters, all_parameters, verbosity: int) -> None:
        """Record the model and ASP's ``(module_name, module, p_name, p, mask, pruned)`` sparse parameters
        (their weights drive the search); clears the statistics."""
        cls._verbosity = verbosity
        cls._model = model
        cls._sparse_parameters = list(sparse_parameters)
        cls._all_parameters = list(all_parameters)
        cls._params_permuted_in_C, cls._params_permuted_in_K, cls._unpermuted_dims = [], [], []
        cls._applied = []

    @classmethod
    def get_permutation_stats(cls) -> tuple[list, list, list]:
        """Names of the tensors permuted along C, along K, and of those a permutation could not be applied to."""
        return cls._params_permuted_in_C, cls._params_permuted_in_K, cls._unpermuted_dims

    @classmethod
    def build_fx_graph(cls, model, dump_fx_graph: bool = False,
                       save_dumped_fx_graph: str = "./model_fx_graph.json") -> tuple[dict, bool]:
        """Trace ``model`` with ``torch.fx``; returns ``({node name: info}, success)``, the traced module kept
        under the ``"__graph_module__"`` key."""
        try:
            gm = torch.fx.symbolic_trace(model)
        except Exception as exc:  # noqa: BLE001 - any tracing failure means "do not permute"
            _log.warning("[permute_model] cannot trace %s with torch.fx (%s: %s); not permuting",
                         type(model).__name__, type(exc).__name__, exc)
            return {}, False
        graph = {}
        for node in gm.graph.nodes:
            graph[node.name] = {
                "op": node.op, "target": str(getattr(node.target, "__name__", node.target)),
                "parents": [n.name for n in node.all_input_nodes], "children": [n.name for n in node.users],
            }
        if dump_fx_graph:
            cls.save_graph_to_json(graph, save_dumped_fx_graph)
        graph["__graph_module__"] = gm
        return graph, True

    @classmethod
    def save_graph_to_json(cls, graph: dict, save_dumped_graph_path_with_name: str = "./model_fx_graph.json") -> None:
        plain = {k: v for k, v in graph.items() if not k.startswith("__")}
        with open(save_dumped_graph_path_with_name, "w") as f:
            json.dump(plain, f, indent=2)

    @classmethod
    def find_permutation_for_matrix_group(cls, matrix_group: torch.Tensor) -> tuple[list, bool]:
        """Search a column permutation for ``matrix_group``; skipped (identity, False) when 2:4 pruning
        already keeps more than 99.9% of its magnitude, as in Apex."""
        total = float(matrix_group.abs().sum(dtype=torch.float64))
        kept = sum_after_2_to_4(matrix_group)
        if total == 0 or (total - kept) / total < 1e-3:
            return list(range(matrix_group.shape[1])), False
        options = dict(cls.search_options)
        if matrix_group.shape[1] > 2048:
            options = {"strategy": "progressive channel swap", "progressive_search_time_limit": 120}
        return accelerated_search_for_good_permutation(matrix_group, options=options, verbosity=cls._verbosity), True

    @classmethod
    def _matrix_group(cls, group) -> torch.Tensor | None:
        p = group.period
        blocks = []
        for m in group.members:
            if m.role == "C" and m.sparse:
                w = m.tensor.detach().movedim(1, -1)
                blocks.append(w.reshape(-1, p).to(torch.float64))  # every block of p channels is one more row set
        return torch.cat([b.to(blocks[0].device) for b in blocks]) if blocks else None

    @classmethod
    def _share(cls, perm: list) -> list:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [perm]
            dist.broadcast_object_list(box, src=0)
            perm = box[0]
        return perm

    @classmethod
    @torch.no_grad()
    def _apply(cls, group, perm: list) -> None:
        base = torch.as_tensor(perm, dtype=torch.long)
        for m in group.members:
            t = m.tensor
            n = t.shape[m.dim]
            if n % len(perm):
                cls._unpermuted_dims.append(f"{m.name}[{m.dim}]")
                continue
            idx = replicate_sequence(base.tolist(), n // len(perm)) if n != len(perm) else base.tolist()
            idx_t = torch.as_tensor(idx, dtype=torch.long, device=t.device)
            t.data.copy_(t.data.index_select(m.dim, idx_t))
            cls._applied.append((t, m.dim, idx_t))
            (cls._params_permuted_in_C if m.role == "C" else cls._params_permuted_in_K).append(m.name)

    @classmethod
    def permute_model(cls, model, dump_fx_graph: bool = False,
                      save_dumped_fx_graph: str = "./model_permutation_graph.json") -> bool:
        """Permute ``model``'s weights in place so 2:4 pruning keeps more magnitude; the model computes the
        same function. Returns False (model unchanged) when it cannot be traced."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        out_dir = os.path.split(save_dumped_fx_graph)[0]
        if out_dir:
            cls._permutation_output_dir = out_dir
        graph, ok = cls.build_fx_graph(model, dump_fx_graph, save_dumped_fx_graph)
        if not ok:
            return False
        cls._applied = []
        sparse = [rec[3] for rec in cls._sparse_parameters]
        start = time.perf_counter()
        for i, group in enumerate(analyse(graph.pop("__graph_module__"), sparse)):
            names = [m.name for m in group.members]
            if group.reason is not None:
                cls._say(2, f"[permute_model] group {i} not permuted ({group.reason}): {names}")
                continue
            if group.period < 8 or group.period % 4:
                cls._say(2, f"[permute_model] group {i} not permuted (period {group.period}): {names}")
                continue
            matrix = cls._matrix_group(group)
            if matrix is None:
                continue
            perm, found = cls.find_permutation_for_matrix_group(matrix)
            perm = cls._share(perm)
            if not found or perm == sorted(perm):
                continue
            before, after = sum_after_2_to_4(matrix), sum_after_2_to_4(matrix[:, perm])
            cls._say(1, f"[permute_model] group {i} (period {group.period}): kept magnitude {before:.6g} -> "
                        f"{after:.6g}; permuting {names}")
            cls._apply(group, perm)
        cls._say(1, f"[permute_model] searched and applied permutations in {time.perf_counter() - start:.3f} s")
        if cls._save_permutation_graph:
            cls.save_graph_to_json(graph, os.path.join(cls._permutation_output_dir,
                                                       "model_graph_permutation_graph.json"))
        return True
