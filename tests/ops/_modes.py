"""Dispatch modes shared by the op tests."""

from __future__ import annotations

import torch


class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode (as make_fx, FakeTensorMode or a debugging mode) that records the schema name of every
    op it sees: under one, apex's registered ops must be what runs."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name)
        return func(*args, **(kwargs or {}))
