"""ASP, Automatic SParsity (Apex's ``apex.contrib.sparsity.ASP``): 2:4 structured pruning of a model's weights.

Workflow, as in Apex::

    ASP.init_model_for_pruning(model, "m4n2_1d")     # adds a mask buffer per eligible weight
    ASP.init_optimizer_for_pruning(optimizer)        # step() masks gradients before, weights after
    ASP.compute_sparse_masks()                       # computes the masks and zeroes the pruned weights

State lives on the ``ASP`` class (Apex's API is classmethods; one model per process); ``ASP.reset()``, an
addition to Apex's API, forgets it so another model can be pruned. Eligible weights are those of the
whitelisted module types whose first dimension is a multiple of 8 and second a multiple of 16 (Apex's
tensor-core rule); others are skipped with a log line on the ``apex.contrib.sparsity`` logger.

Differences from Apex: misuse raises ``RuntimeError`` (an unknown whitelist type ``ValueError``), each also
the ``AssertionError`` Apex raised; ``already_init_asp_model`` always returns a bool; the shape rule applies to
every dtype (Apex skips the check for bfloat16); the pruned copies kept by ``allow_recompute_mask`` return to
the weight's own device.

Channel permutation (``allow_permutation=True``, the default as in Apex): ``compute_sparse_masks`` first
permutes the model's channels with :class:`~apex.contrib.sparsity.permutation_lib.Permutation` so that the masks
keep more magnitude; the model computes the same function. Unlike Apex it also permutes the optimizer's state
(Adam moments, momentum) of every permuted parameter, restores dense weights *before* permuting when masks are
recomputed, and does not reseed the global RNGs (the search is deterministic).
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable, Iterable

import torch

from apex._errors import AssertRuntimeError, AssertValueError
from apex.contrib.sparsity.permutation_lib import Permutation
from apex.contrib.sparsity.sparse_masklib import create_mask

_log = logging.getLogger("apex.contrib.sparsity")

_DEFAULT_WHITELIST = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.MultiheadAttention)


def _default_parameter_table() -> dict:
    return {
        torch.nn.Linear: ["weight"],
        torch.nn.Conv1d: ["weight"],
        torch.nn.Conv2d: ["weight"],
        torch.nn.Conv3d: ["weight"],
        torch.nn.modules.linear.NonDynamicallyQuantizableLinear: ["weight"],
        torch.nn.MultiheadAttention: ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_weight"],
    }


def eligible_modules(model: torch.nn.Module, whitelist_layer_types: tuple, allowed_layer_names, disallowed_layer_names):
    """``(name, module)`` for modules of the whitelisted types, filtered by the allowed/disallowed names."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, whitelist_layer_types) and name not in disallowed_layer_names:
            if allowed_layer_names is not None and name not in allowed_layer_names:
                continue
            out.append((name, mod))
    return out


def _shape_ok(p: torch.Tensor) -> bool:
    # Apex's rule for sparse tensor cores: K % 8 == 0 and C % 16 == 0 (weights are (K, C, ...)).
    return p.dim() >= 2 and p.shape[0] % 8 == 0 and p.shape[1] % 16 == 0


class ASP:
    """Class-level pruning state and Apex's classmethod API (see the module docstring)."""

    _model = None
    _verbosity = 0
    _optimizer = None
    _original_step = None
    _step_was_instance_attribute = False
    _sparse_parameters: list = []
    _calculate_mask = None
    _allow_permutation = True
    _save_permutation_graph = False
    _permutation_output_dir = "."

    @classmethod
    def _say(cls, level: int, msg: str) -> None:
        # verbosity 0: errors, 1: +warnings, 2: +info, 3: +debug (Apex's levels)
        if cls._verbosity >= level:
            (_log.warning if level <= 1 else _log.info if level == 2 else _log.debug)(msg)

    @classmethod
    def reset(cls) -> None:
        """Forget the model, optimizer and masks (the optimizer's ``step`` is restored). Not in Apex."""
        if cls._optimizer is not None and cls._original_step is not None:
            if cls._step_was_instance_attribute:
                cls._optimizer.step = cls._original_step
            else:  # drop our instance attribute so the class's step shows through again
                del cls._optimizer.step
        cls._model = None
        cls._verbosity = 0
        cls._optimizer = None
        cls._original_step = None
        cls._sparse_parameters = []
        cls._calculate_mask = None
        cls._allow_permutation = True
        cls._save_permutation_graph = False
        cls._permutation_output_dir = "."
        Permutation.set_permutation_params_from_asp(None, [], [], 0)
        # Permutation keeps its own copy of the saving switches: a later search must not dump its graph
        # into the working directory because an earlier model asked for a dump elsewhere.
        Permutation.set_permutation_saving_params(False, False, ".")

    @classmethod
    def init_model_for_pruning(
        cls,
        model: torch.nn.Module,
        mask_calculator: str | Callable = "m4n2_1d",
        verbosity: int = 3,
        whitelist: Iterable[type] = _DEFAULT_WHITELIST,
        allowed_layer_names=None,
        disallowed_layer_names=(),
        allow_recompute_mask: bool = False,
        custom_layer_dict=None,
        allow_permutation: bool = True,
    ) -> None:
        """Register a ``__<name>_mma_mask`` buffer (all ones) for every eligible weight; sparsity stays off
        until ``compute_sparse_masks``. ``mask_calculator`` is a pattern name for ``create_mask`` or a callable
        ``tensor -> mask``. With ``allow_recompute_mask`` the pruned values are kept on the CPU
        (``__<name>_mma_pruned_p``) so dense weights can be restored."""
        if cls._model is not None:
            raise AssertRuntimeError("ASP has been initialized already (call ASP.reset() to prune another model)")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(mask_calculator, str):
            create_mask(torch.ones(1, 4), mask_calculator)  # validates the pattern name before any change

            def calculate(param, _pattern=mask_calculator):
                return create_mask(param, _pattern).bool()
        elif callable(mask_calculator):
            calculate = mask_calculator
        else:
            kind = type(mask_calculator).__name__
            raise TypeError(f"mask_calculator must be a pattern name or a callable, got {kind}")
        table = _default_parameter_table()
        whitelist = list(whitelist)
        if custom_layer_dict:
            table.update(custom_layer_dict)
            whitelist += [t for t in custom_layer_dict if t not in whitelist]
        for module_type in whitelist:
            if module_type not in table:
                raise AssertValueError(f"whitelist: don't know how to sparsify {module_type!r}; pass custom_layer_dict")

        def names_for(module):
            for klass in type(module).__mro__:
                if klass in table:
                    return table[klass]
            return []

        sparse = []
        for module_name, module in eligible_modules(model, tuple(whitelist), allowed_layer_names,
                                                    disallowed_layer_names):
            wanted = names_for(module)
            for p_name, p in module.named_parameters(recurse=False):
                if p_name not in wanted or not p.requires_grad:
                    cls._say_at(verbosity, 3, f"[ASP] Not sparsifying {module_name}::{p_name} of size="
                                f"{tuple(p.shape)} and type={p.dtype}")
                    continue
                if not _shape_ok(p):
                    _log.warning("[ASP] Auto skipping pruning %s::%s of size=%s and type=%s for sparsity",
                                 module_name, p_name, tuple(p.shape), p.dtype)
                    continue
                cls._say_at(verbosity, 3, f"[ASP] Sparsifying {module_name}::{p_name} of size={tuple(p.shape)} "
                            f"and type={p.dtype} for sparsity")
                sparse.append((module_name, module, p_name, p))

        records = []
        for module_name, module, p_name, p in sparse:
            mask = torch.ones_like(p, dtype=torch.bool)
            buf = p_name.split(".")[-1]
            module.register_buffer(f"__{buf}_mma_mask", mask)
            pruned = None
            if allow_recompute_mask:
                pruned = torch.zeros_like(p, device="cpu")
                module.register_buffer(f"__{buf}_mma_pruned_p", pruned)
            records.append((module_name, module, p_name, p, mask, pruned))
        cls._model = model
        cls._verbosity = verbosity
        cls._calculate_mask = calculate
        cls._sparse_parameters = records
        cls._allow_permutation = allow_permutation
        if allow_permutation:
            every = [(mn, m, pn, p) for mn, m in model.named_modules() for pn, p in m.named_parameters(recurse=False)]
            Permutation.set_permutation_params_from_asp(model, records, every, verbosity)

    @classmethod
    def _say_at(cls, verbosity: int, level: int, msg: str) -> None:
        if verbosity >= level:
            _log.debug(msg) if level >= 3 else _log.info(msg)

    @classmethod
    def already_init_asp_model(cls) -> bool:
        """Whether ``init_model_for_pruning`` has been called."""
        done = cls._model is not None
        cls._say(3, "[ASP] ASP has been initialized already." if done else "[ASP] ASP has not been initialized.")
        return done

    @classmethod
    def init_optimizer_for_pruning(cls, optimizer: torch.optim.Optimizer) -> None:
        """Patch ``optimizer.step`` so gradients are masked before and weights after every step."""
        if cls._optimizer is not None:
            raise AssertRuntimeError("ASP has initialized optimizer already.")
        if cls._calculate_mask is None:
            raise AssertRuntimeError("Called ASP.init_optimizer_for_pruning before ASP.init_model_for_pruning.")
        original = optimizer.step
        records = cls._sparse_parameters

        def step(opt_self, *args, **kwargs):
            with torch.no_grad():
                for _, _, _, p, mask, _ in records:
                    if p.grad is not None:
                        p.grad.mul_(mask)
            result = original(*args, **kwargs)
            with torch.no_grad():
                for _, _, _, p, mask, _ in records:
                    p.mul_(mask)
            return result

        cls._optimizer = optimizer
        cls._original_step = original
        cls._step_was_instance_attribute = "step" in vars(optimizer)
        optimizer.step = types.MethodType(step, optimizer)

    @classmethod
    def compute_sparse_masks(cls) -> None:
        """Compute every mask from the current weights and zero the pruned weights in place. When masks
        were already computed, the dense weights are first restored (needs ``allow_recompute_mask``)."""
        if cls._calculate_mask is None:
            raise AssertRuntimeError("Called ASP.compute_sparse_masks before ASP.init_model_for_pruning.")
        for module_name, _, p_name, _, mask, pruned in cls._sparse_parameters:
            if pruned is None and not bool(mask.all()):
                raise AssertRuntimeError(f"Unable to restore dense parameter {module_name}::{p_name} to recompute its "
                                   "mask because allow_recompute_mask == False")
        with torch.no_grad():
            for _, _, _, p, mask, pruned in cls._sparse_parameters:
                if pruned is not None and not bool(mask.all()):  # recomputing: back to the dense weights
                    p.add_(pruned.to(p.device))
                    mask.fill_(True)
                    pruned.zero_()
        if cls._allow_permutation:
            cls._permute()
        with torch.no_grad():
            for module_name, _, p_name, p, mask, pruned in cls._sparse_parameters:
                new_mask = cls._calculate_mask(p)
                mask.copy_(new_mask.to(device=mask.device, dtype=torch.bool).reshape(mask.shape))
                if pruned is not None:
                    pruned.copy_((p * ~mask).to(pruned.device))
                p.mul_(mask)
                cls._say(2, f"[ASP] Enabled {100.0 - 100.0 * float(mask.sum()) / mask.numel():.2f}% sparsity for "
                         f"{module_name}::{p_name} of size={tuple(p.shape)} and type={p.dtype}")

    @classmethod
    def _permute(cls) -> None:
        """Permute the model's channels (the wrapped ``.module`` of a DDP-style wrapper first, as Apex), then
        the optimizer state of every permuted parameter the same way."""
        start = time.perf_counter()
        inner = getattr(cls._model, "module", None)
        target = inner if isinstance(inner, torch.nn.Module) else cls._model
        out = os.path.join(cls._permutation_output_dir, "model_offline_permutation_graph.json")
        done = Permutation.permute_model(target, dump_fx_graph=cls._save_permutation_graph, save_dumped_fx_graph=out)
        if not done:
            return
        if cls._optimizer is not None:
            with torch.no_grad():
                for t, dim, idx in Permutation._applied:
                    for value in cls._optimizer.state.get(t, {}).values():
                        if isinstance(value, torch.Tensor) and value.shape == t.shape:
                            value.copy_(value.index_select(dim, idx.to(value.device)))
        cls._say(2, f"[ASP] found and applied channel permutations in {time.perf_counter() - start:.3f} s")

    @classmethod
    def restore_pruned_weights(cls) -> None:
        """Turn sparsity off: add the stored pruned values back and reset the masks to ones (needs
        ``allow_recompute_mask``)."""
        for module_name, _, p_name, _, mask, pruned in cls._sparse_parameters:
            if pruned is None and not bool(mask.all()):
                raise AssertRuntimeError(f"Unable to restore dense parameter {module_name}::{p_name} because "
                                   "allow_recompute_mask == False")
        with torch.no_grad():
            for module_name, _, p_name, p, mask, pruned in cls._sparse_parameters:
                if not bool(mask.all()):
                    p.add_(pruned.to(p.device))
                    mask.fill_(True)
                    pruned.zero_()
                    cls._say(2, f"[ASP] Disabled sparsity for {module_name}::{p_name} (dense weights restored)")

    @classmethod
    def is_sparsity_enabled(cls) -> bool:
        """True when every mask is 50% dense, False when every mask is all ones; ``RuntimeError`` otherwise."""
        total = sp100 = sp50 = 0
        for *_, mask, _ in cls._sparse_parameters:
            total += 1
            kept, numel = int(mask.sum()), mask.numel()
            sp100 += kept == numel
            sp50 += kept * 2 == numel
        if total == sp100:
            return False
        if total == sp50:
            return True
        raise AssertRuntimeError("Inconsistent model sparsity")

    @classmethod
    def prune_trained_model(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Apex's one-call recipe: m4n2_1d masks for Linear, Conv2d and MultiheadAttention weights."""
        cls.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2,
                                   whitelist=[torch.nn.Linear, torch.nn.Conv2d, torch.nn.MultiheadAttention],
                                   allow_recompute_mask=False)
        cls.init_optimizer_for_pruning(optimizer)
        cls.compute_sparse_masks()

    @classmethod
    def set_permutation_saving_params(cls, allow_permutation: bool = True, save_permutation_graph: bool = False,
                                      permutation_output_dir: str = ".") -> None:
        """Turn the channel permutation of ``compute_sparse_masks`` on or off; with ``save_permutation_graph``
        the traced graph is written as JSON under ``permutation_output_dir``."""
        cls._allow_permutation = allow_permutation
        cls._save_permutation_graph = save_permutation_graph
        cls._permutation_output_dir = permutation_output_dir
        Permutation.set_permutation_saving_params(allow_permutation, save_permutation_graph, permutation_output_dir)
        if allow_permutation and Permutation._model is None and cls._model is not None:
            Permutation.set_permutation_params_from_asp(cls._model, cls._sparse_parameters, [], cls._verbosity)
        cls._say(2, f"[ASP] permutation: allow={allow_permutation}, save graph={save_permutation_graph}, "
                 f"dir={permutation_output_dir}")
