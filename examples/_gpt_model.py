"""The byte-level GPT of ``train_gpt.py``: its data (the standard library's own source, no download) and its
one-process model (nanoGPT-style decoder with tied input/output embeddings).

``_gpt_parallel.py`` builds the tensor- and pipeline-parallel version of the same model from these weights.
"""

from __future__ import annotations

import math
import sysconfig
import zlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from apex.normalization import FusedLayerNorm, FusedRMSNorm

VOCAB = 256  # bytes

# ----------------------------------------------------------------------------------------------------------
# Data: the standard library's source, as bytes.


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return root, sorted(files)


def load_corpus(val_fraction: float = 0.1, max_mb: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Concatenate the stdlib's ``.py`` files into a train and a validation byte tensor.

    A file goes to validation when ``crc32(relative path) % 1000 < 1000 * val_fraction``: the split is
    the same on every machine and every run, and no file straddles both sets.
    """
    root, files = stdlib_files()
    if not files:
        raise SystemExit(f"error: no .py files found under the standard library directory {root}")
    train, val = [], []
    budget = int(max_mb * 2**20) if max_mb > 0 else None
    used = 0
    for p in files:
        rel = p.relative_to(root).as_posix()
        data = p.read_bytes()
        to_val = zlib.crc32(rel.encode()) % 1000 < 1000 * val_fraction
        (val if to_val else train).append(data)
        used += len(data)
        if budget is not None and used >= budget:
            break
    train_t = torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8)
    val_t = torch.frombuffer(bytearray(b"".join(val)), dtype=torch.uint8)
    info = {"root": str(root), "files": len(train) + len(val), "train_bytes": train_t.numel(),
            "val_bytes": val_t.numel()}
    return train_t, val_t, info


def get_batch(data: torch.Tensor, batch_size: int, block: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch drawn from its own generator: batch ``seed`` is the same whether or not a run was resumed."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - block - 1, (batch_size,), generator=g)
    chunk = data[starts[:, None] + torch.arange(block + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]


def batch_seed(seed: int, step: int, rank: int, world_size: int) -> int:
    return (seed * 1_000_003 + step) * world_size + rank


# ----------------------------------------------------------------------------------------------------------
# Model: nanoGPT-style decoder.


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: str,
                     future: torch.Tensor | None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + causal mask) v`` over ``[batch, heads, time, head_dim]``; "math" takes the
    boolean ``future`` mask (True above the diagonal) and computes the softmax in fp32."""
    if attention == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    att = att.float().masked_fill(future[:t, :t], float("-inf")).softmax(-1)  # fp32 softmax
    return att.to(v.dtype) @ v


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention, computed by ``F.scaled_dot_product_attention`` ("sdpa") or by two
    matmuls around a softmax ("math"): the same function, and on CPUs in bf16 "math" is ~3x faster because
    the matmuls use the bf16 GEMMs while PyTorch's fused CPU attention kernel is slow in bf16."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, attention: str):
        super().__init__()
        self.n_head, self.attention = n_head, attention
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        if attention == "math":
            future = torch.ones(block_size, block_size, dtype=torch.bool).triu(1)
            self.register_buffer("future", future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = causal_attention(q, k, v, self.attention, getattr(self, "future", None))
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, norm: type[nn.Module], attention: str):
        super().__init__()
        self.ln1 = norm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, attention)
        self.ln2 = norm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.out = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, norm: type[nn.Module],
                 attention: str = "sdpa", vocab: int = VOCAB):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"--n-embd ({n_embd}) must be divisible by --n-head ({n_head})")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size, norm, attention) for _ in range(n_layer))
        self.ln_f = norm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied input/output embedding
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2 init: residual projections shrink with depth so the residual stream stays O(1).
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, prompt: bytes, n: int, temperature: float = 0.8, top_k: int = 40,
                 seed: int = 0) -> bytes:
        device = self.wte.weight.device
        g = torch.Generator(device=device).manual_seed(seed)
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        for _ in range(n):
            logits, _ = self(idx[:, -self.block_size:])
            logits = logits[:, -1].float() / temperature
            kth = torch.topk(logits, top_k).values[:, -1:]
            probs = F.softmax(logits.masked_fill(logits < kth, -float("inf")), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)], dim=1)
        return bytes(idx[0].tolist())


def attention_kind(args, dtype: torch.dtype, device: torch.device) -> str:
    """``--attention auto``: the faster kernel for the run's compute dtype (measured on CPUs: fused SDPA in
    fp32, matmul + softmax in bf16/fp16); fused SDPA on GPUs."""
    if args.attention != "auto":
        return args.attention
    return "math" if dtype != torch.float32 and device.type == "cpu" else "sdpa"


def norm_class(impl: str, norm: str) -> type[nn.Module]:
    if impl == "torch":
        return nn.LayerNorm if norm == "layer" else nn.RMSNorm
    return FusedLayerNorm if norm == "layer" else FusedRMSNorm


def make_model(args, impl: str, dtype: torch.dtype, device: torch.device) -> GPT:
    return GPT(args.n_layer, args.n_head, args.n_embd, args.block_size, norm_class(impl, args.norm),
               attention_kind(args, dtype, device)).to(device)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only (embeddings included), never norms' weights and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10% of ``--lr`` at ``--steps``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))

