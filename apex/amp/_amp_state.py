"""Process-wide amp state, shared by ``initialize``, ``scale_loss`` and the checkpoint functions.

Apex keeps one ``_amp_state`` object per process and so do we: ``amp.initialize`` configures it and every
other ``amp.*`` call reads it. The object is reset by each ``initialize`` call.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class AmpState:
    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1


_amp_state = AmpState()


def warn_or_err(msg: str) -> None:
    """Raise ``RuntimeError(msg)``, or only print it when ``_amp_state.hard_override`` is set."""
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)


def maybe_print(msg: str, rank0: bool = False) -> None:
    """Print ``msg`` when ``verbosity > 0`` (only on rank 0 of a process group when ``rank0``)."""
    if _amp_state.verbosity <= 0:
        return
    if rank0:
        distributed = (torch.distributed.is_available() and torch.distributed.is_initialized()
                       and torch.distributed.get_world_size() > 1)
        if distributed and torch.distributed.get_rank() != 0:
            return
    print(msg)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Iterate over the parameters owned by ``optimizer`` (the fp32 master copies under O2).

    Args:
        optimizer: an optimizer returned by ``amp.initialize``.
    """
    for group in optimizer.param_groups:
        yield from group["params"]
