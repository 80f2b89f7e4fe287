"""A training step of a small transformer block on CPU: amp O1/O2 in bf16 against fp32, and O1 against
PyTorch's own mixed precision (``torch.autocast`` + ``GradScaler``)."""

import torch
import torch.nn as nn

from apex import amp
from apex.amp import _amp_state
from benchmarks._harness import Case

BATCH, SEQ, D_MODEL, HEADS, FFN = 8, 64, 256, 4, 1024


def _block(seed=0):
    torch.manual_seed(seed)
    return nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, D_MODEL, generator=g)


def _fp32_step():
    model = _block()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = _data()

    def step():
        with torch.autocast("cpu", enabled=False):
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()

    return step


def _torch_amp_step():
    model = _block()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    x = _data()

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def _amp_step(opt_level):
    model = _block()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, half_dtype=torch.bfloat16)
    handle = getattr(_amp_state, "handle", None)
    if handle is not None:
        # O1 switches autocast on process-wide; keep it on only inside our step so the other side and
        # the benchmarks that follow run untouched.
        handle._deactivate()
    x = _data()

    def step():
        if handle is not None:
            handle._activate()
        try:
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        finally:
            if handle is not None:
                handle._deactivate()

    return step


def cases():
    return [
        Case("amp O1 bf16 transformer step", timed=lambda: (_amp_step("O1"), _fp32_step()),
             torch_label="fp32 step", repeats=9),
        Case("amp O2 bf16 transformer step", timed=lambda: (_amp_step("O2"), _fp32_step()),
             torch_label="fp32 step", repeats=9),
        Case("amp O1 bf16 vs torch.autocast", timed=lambda: (_amp_step("O1"), _torch_amp_step()),
             torch_label="autocast+GradScaler", repeats=9),
    ]
