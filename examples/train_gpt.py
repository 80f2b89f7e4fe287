"""Train a small GPT on the Python standard library's own source code, with apex.

A byte-level language model (vocabulary of 256 bytes, no tokenizer, nothing to download): the text is every
``.py`` file of the standard library of the Python that runs this script (``sysconfig``), split into
training and validation files deterministically by a hash of each file's relative path.

apex pieces used:
  * ``apex.amp`` with ``amp.scale_loss``: O1 in bf16 on CPUs that have bf16 hardware (AVX512-BF16 or AMX)
    and in fp16 on GPUs; O0 (fp32) on CPUs without it, where bf16 is emulated and 30-85x slower
    (``--dtype`` / ``--opt-level`` override the choice, ``python -m apex`` shows what the machine has);
  * ``apex.optimizers.FusedAdam`` (AdamW mode);
  * ``apex.normalization.FusedLayerNorm`` (or ``FusedRMSNorm`` with ``--norm rms``);
  * ``apex.parallel.DistributedDataParallel`` when started with ``torchrun --nproc_per_node N``
    (Gloo on CPUs, NCCL on GPUs). Every collective times out after ``--dist-timeout`` seconds, so a rank
    that dies or hangs makes the others fail with PyTorch's timeout error instead of waiting forever.

Examples::

    python examples/train_gpt.py                      # a few minutes on 2 CPU cores
    python examples/train_gpt.py --compare            # apex (amp + fused) vs plain PyTorch fp32
    python examples/train_gpt.py --save runs/ckpt     # checkpoint every --save-every steps
    python examples/train_gpt.py --resume runs/ckpt   # continue exactly where it stopped
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 20
    python examples/train_gpt.py --device cuda --dtype bf16   # GPUs: Triton kernels, fp16 unless told
    torchrun --nnodes 2 --node_rank R --master_addr HOST --master_port 29500 --nproc_per_node 8 \
        examples/train_gpt.py                                   # several machines (NCCL on GPUs)

Outputs go to ``--out`` (default ``runs/train_gpt``): ``metrics.json`` and ``loss.png`` (``compare.png`` with
``--compare``). ``--compare`` trains both models in one process, alternating steps on the same batches, so
that both see the same machine load and the speed ratio is fair on a busy machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from apex import _hardware, amp
from apex.normalization import FusedLayerNorm, FusedRMSNorm
from apex.optimizers import FusedAdam
from apex.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    CheckpointError,
    DistInfo,
    add_runtime_args,
    cleanup_distributed,
    format_table,
    gather_checksums,
    load_checkpoint,
    peak_memory_mib,
    plot_losses,
    require_positive,
    save_checkpoint,
    set_cpu_threads,
    setup_distributed,
)

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
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            att = att.float().masked_fill(self.future[:t, :t], float("-inf")).softmax(-1)  # fp32 softmax
            y = att.to(v.dtype) @ v
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
                 attention: str = "sdpa", vocab: int = 256):
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


def make_model(args, impl: str, dtype: torch.dtype, device: torch.device) -> GPT:
    if impl == "torch":
        norm = nn.LayerNorm if args.norm == "layer" else nn.RMSNorm
    else:
        norm = FusedLayerNorm if args.norm == "layer" else FusedRMSNorm
    return GPT(args.n_layer, args.n_head, args.n_embd, args.block_size, norm,
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


# ----------------------------------------------------------------------------------------------------------
# Training.


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


STEPS_HALF, STEPS_FP32 = 400, 200


def default_steps(args, device: torch.device) -> int:
    """Fewer steps when the run computes in fp32, so that the first command takes minutes on any CPU."""
    dtype = choose_precision(args, device)[0] if args.impl == "apex" else torch.float32
    return STEPS_FP32 if dtype == torch.float32 else STEPS_HALF


def choose_precision(args, device: torch.device) -> tuple[torch.dtype, str, str]:
    """``(compute dtype, amp opt_level, why)`` for the apex run.

    ``--dtype auto`` picks a half type only where the hardware computes in it (``apex._hardware``): on CPUs
    bf16 with AVX512-BF16 or AMX, on GPUs fp16 (compute capability 7.0+) or bf16 (8.0+); elsewhere fp32
    with amp O0, still with FusedAdam and the fused norm. On a CPU without bf16 hardware a bf16 matmul takes
    30-85x the time of the fp32 one, which would turn a 2-minute run into hours. An explicit ``--dtype``
    or ``--opt-level`` is obeyed (amp warns once when the half type is emulated).
    """
    cap = _hardware.capability(device)
    if args.opt_level == "O0":
        return torch.float32, "O0", "--opt-level O0"
    if args.dtype != "auto":
        dtype = DTYPES[args.dtype]
        return dtype, "O0" if dtype == torch.float32 else args.opt_level or "O1", f"--dtype {args.dtype}"
    preferred = (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.bfloat16, torch.float16)
    for dtype in preferred:
        if cap.has(dtype):
            return dtype, args.opt_level or "O1", f"--dtype auto: {cap.reason}"
    if args.opt_level is not None:  # a half opt level asked for by name: do it, in the default half type
        return preferred[0], args.opt_level, f"--opt-level {args.opt_level}, although {cap.reason}"
    return torch.float32, "O0", f"--dtype auto: {cap.reason}"


class Run:
    """One model with its optimizer, trained step by step: apex (amp + FusedAdam + fused norm) or the plain
    PyTorch fp32 baseline. ``--compare`` trains one of each on the same batches, step for step, so that the
    speed ratio is measured under the same machine load."""

    def __init__(self, args, info: DistInfo, impl: str):
        self.args, self.info, self.impl, self.use_amp = args, info, impl, impl == "apex"
        if self.use_amp:
            self.dtype, self.opt_level, self.why = choose_precision(args, info.device)
        else:
            self.dtype, self.opt_level, self.why = torch.float32, None, "the plain PyTorch baseline"
        torch.manual_seed(args.seed)  # both implementations start from the same weights
        model = make_model(args, impl, self.dtype, info.device)
        self.attention = attention_kind(args, self.dtype, info.device)
        self.n_params = sum(p.numel() for p in model.parameters())
        groups = param_groups(model, args.weight_decay)
        if self.use_amp:
            optimizer = FusedAdam(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True)
            half = self.dtype if self.dtype != torch.float32 else None
            model, optimizer = amp.initialize(model, optimizer, opt_level=self.opt_level, verbosity=0,
                                              half_dtype=half)
        else:
            optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        self.raw, self.optimizer = model, optimizer
        self.model = DDP(model) if info.distributed else model
        self.history: dict[str, list] = {"train": [], "val": []}
        self.train_time, self.timed_steps = 0.0, 0

    def casting(self):
        """amp O1 switches autocast on for the whole process (as Apex's O1 patched torch functions
        globally), so the fp32 baseline of ``--compare`` switches it off around all its own work: forward,
        backward (autograd replays the autocast state of the thread that calls ``backward()``), clipping
        and the optimizer step."""
        return contextlib.nullcontext() if self.use_amp else torch.autocast(self.info.device.type, enabled=False)

    def load(self, state: dict) -> None:
        try:
            self.raw.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.use_amp:
                amp.load_state_dict(state["amp"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"cannot resume from {self.args.resume}: {exc}") from exc
        self.history = state["history"]

    def state(self, step: int) -> dict:
        return {"model": self.raw.state_dict(), "optimizer": self.optimizer.state_dict(),
                "amp": amp.state_dict() if self.use_amp else None, "step": step,
                "config": vars(self.args), "history": self.history}

    def train_step(self, step: int, x: torch.Tensor, y: torch.Tensor, timed: bool) -> float:
        args, info = self.args, self.info
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        with self.casting():
            logits, loss = self.model(x, y)
            if not self.use_amp and logits.dtype != torch.float32:
                raise RuntimeError(f"the fp32 baseline computed in {logits.dtype}: mixed precision leaked in")
            if self.use_amp:
                with amp.scale_loss(loss, self.optimizer) as scaled_loss:  # backward without O1's casts
                    scaled_loss.backward()
                params = amp.master_params(self.optimizer)  # gradients are unscaled when the block exits
            else:
                loss.backward()
                params = self.model.parameters()
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss_t = loss.detach().float()
        if info.distributed:
            dist.all_reduce(loss_t)
            loss_t /= info.world_size
        value = loss_t.item()  # waits for the step to finish, so the timing is honest
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        if timed:
            self.train_time += time.perf_counter() - t0
            self.timed_steps += 1
        if not math.isfinite(value):
            raise FloatingPointError(f"{self.impl}: training diverged at step {step} (loss {value})")
        self.history["train"].append((step, value))
        return value

    @torch.no_grad()
    def evaluate(self, val: torch.Tensor) -> float:
        """Mean loss over a fixed set of validation batches, shared out among the ranks."""
        args, info = self.args, self.info
        self.raw.eval()
        total = torch.zeros(2, dtype=torch.float64, device=info.device)  # NCCL reduces device tensors only
        for i in range(info.rank, args.eval_batches, info.world_size):
            x, y = get_batch(val, args.batch_size, args.block_size, seed=10_000_019 + i)
            with self.casting():
                _, loss = self.raw(x.to(info.device), y.to(info.device))
            total[0] += loss.double()
            total[1] += 1
        if info.distributed:
            dist.all_reduce(total)
        self.raw.train()
        return (total[0] / total[1]).item()

    def tokens_per_s(self) -> float:
        tokens = self.args.batch_size * self.args.block_size * self.info.world_size
        return tokens * self.timed_steps / self.train_time if self.train_time else float("nan")

    def state_mib(self) -> float:
        """Parameters (and amp's master copies, if any) plus optimizer state, in MiB."""
        tensors = {id(p): p for p in self.raw.parameters()}
        for group in self.optimizer.param_groups:
            tensors.update((id(p), p) for p in group["params"])
        for st in self.optimizer.state.values():
            tensors.update((id(t), t) for t in st.values() if torch.is_tensor(t))
        return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20

    def result(self, done: int) -> dict:
        h = self.history
        tail = [v for _, v in h["train"]][-self.args.eval_interval:] or [float("nan")]
        return {
            "impl": self.impl, "dtype": str(self.dtype).replace("torch.", ""), "attention": self.attention,
            "opt_level": self.opt_level, "why": self.why,
            "steps": done,
            "finished": done >= self.args.steps, "params": self.n_params, "tokens_per_s": self.tokens_per_s(),
            "train_time_s": self.train_time, "final_train_loss": sum(tail) / len(tail), "train_tail": len(tail),
            "first_val_loss": h["val"][0][1] if h["val"] else float("nan"),
            "final_val_loss": h["val"][-1][1] if h["val"] else float("nan"),
            "state_mib": self.state_mib(), "checksums": gather_checksums(self.raw, self.info), "history": h,
        }


def read_resume_state(args) -> dict | None:
    """Read and check ``--resume``'s checkpoint before any work is done, so a bad one fails fast."""
    if not args.resume:
        return None
    state = load_checkpoint(args.resume, ["model", "optimizer", "amp", "step", "config", "history"])
    mismatched = {k: (state["config"].get(k), getattr(args, k)) for k in MODEL_KEYS
                  if state["config"].get(k) != getattr(args, k)}
    if mismatched:
        raise CheckpointError(f"cannot resume from {args.resume}: it was written with different settings "
                              f"(checkpoint vs now: {mismatched})")
    if (args.impl == "apex") != (state["amp"] is not None) or not 0 <= int(state["step"]) <= args.steps:
        raise CheckpointError(f"cannot resume from {args.resume}: its amp state or step count is inconsistent")
    return state


MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "norm", "attention", "impl", "batch_size", "seed", "steps",
              "lr", "warmup", "weight_decay", "grad_clip", "opt_level", "dtype", "data_mb")


def train(args, info: DistInfo) -> dict:
    resume_state = read_resume_state(args)
    train_data, val_data, data_info = load_corpus(max_mb=args.data_mb)
    runs = [Run(args, info, impl) for impl in (("apex", "torch") if args.compare else (args.impl,))]
    start = 0
    if resume_state is not None:
        runs[0].load(resume_state)
        start = int(resume_state["step"])
        if info.is_main:
            print(f"resumed from {args.resume} at step {start}/{args.steps}", flush=True)
    save_dir = args.save or args.resume
    if info.is_main:
        for run in runs:
            print(f"{run.impl}: computes in {str(run.dtype).replace('torch.', '')}"
                  + (f" with amp {run.opt_level}" if run.use_amp else "") + f" ({run.why})", flush=True)

    def checkpoint(step: int) -> None:
        if save_dir and info.is_main:
            save_checkpoint(save_dir, runs[0].state(step))

    bar = tqdm(total=args.steps, initial=start, disable=not info.is_main or args.no_progress, unit="step",
               dynamic_ncols=True, desc="train", file=sys.stderr)
    stop = args.steps if args.stop_at is None else max(start, min(args.steps, args.stop_at))
    postfix: dict[str, str] = {}

    def show(run: Run, loss: float) -> None:
        at, v = run.history["val"][-1] if run.history["val"] else (0, float("nan"))
        postfix[run.impl] = f"loss {loss:.3f} val {v:.3f} (step {at}) {run.tokens_per_s():,.0f} tok/s"

    def validate(step: int) -> None:
        for run in runs:
            if not run.history["val"] or run.history["val"][-1][0] != step:
                run.history["val"].append((step, run.evaluate(val_data)))
        if info.is_main:  # a run stopped with Ctrl-C keeps the metrics and plot of its last validation
            write_progress(Path(args.out), runs, step)

    for step in range(start, stop):
        if step % args.eval_interval == 0:
            validate(step)
        x, y = get_batch(train_data, args.batch_size, args.block_size,
                         batch_seed(args.seed, step, info.rank, info.world_size))
        x, y = x.to(info.device), y.to(info.device)
        for run in runs:
            # The first step of a process pays one-off costs (allocator warm-up, kernel selection).
            show(run, run.train_step(step, x, y, timed=step > start))
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            checkpoint(step + 1)
    if stop >= args.steps:
        validate(stop)
        for run in runs:  # the bar's last line shows the final validation, not the one of step 0
            show(run, run.history["train"][-1][1] if run.history["train"] else float("nan"))
        bar.set_postfix(postfix, refresh=True)
    bar.close()
    checkpoint(stop)

    peak, peak_kind = peak_memory_mib(info.device)
    out = {"runs": {run.impl: run.result(stop) for run in runs}, "steps": stop, "finished": stop >= args.steps,
           "world_size": info.world_size, "threads": torch.get_num_threads(), "device": str(info.device),
           "tokens_per_step": args.batch_size * args.block_size * info.world_size,
           "peak_memory_mib": peak, "peak_memory_kind": peak_kind, "data": data_info, "config": vars(args)}
    if args.compare:
        a, t = out["runs"]["apex"], out["runs"]["torch"]
        out["speed_ratio"] = a["tokens_per_s"] / t["tokens_per_s"]
        out["val_loss_rel_diff"] = (a["final_val_loss"] - t["final_val_loss"]) / t["final_val_loss"]
        out["train_loss_rel_diff"] = (a["final_train_loss"] - t["final_train_loss"]) / t["final_train_loss"]
    if info.is_main and out["finished"] and args.sample_len > 0:
        text = runs[0].raw.generate(b"def ", args.sample_len, seed=args.seed)
        out["sample"] = text.decode("utf-8", errors="replace")
    return out


# ----------------------------------------------------------------------------------------------------------
# Reporting.

LABELS = {"apex": "apex", "torch": "PyTorch"}


def write_progress(directory: Path, runs: list[Run], step: int) -> None:
    """``metrics.json`` (``"finished": false``) and the loss plot as of the validation at ``step``; the end of
    the run overwrites both with the full report."""
    directory.mkdir(parents=True, exist_ok=True)
    partial = {"steps": step, "finished": False, "runs": {
        r.impl: {"impl": r.impl, "dtype": str(r.dtype).replace("torch.", ""), "opt_level": r.opt_level,
                 "why": r.why, "tokens_per_s": r.tokens_per_s(), "history": r.history} for r in runs}}
    tmp = directory / "metrics.json.tmp"
    tmp.write_text(json.dumps(partial, indent=1))
    os.replace(tmp, directory / "metrics.json")  # never a half-written file, whenever Ctrl-C comes
    plot_losses(directory / ("compare.png" if len(runs) == 2 else "loss.png"),
                {f"{LABELS[r.impl]} {partial['runs'][r.impl]['dtype']}": r.history for r in runs},
                f"step {step} of {runs[0].args.steps} (in progress)")


def describe(r: dict, norm: str) -> str:
    if r["impl"] == "apex":
        return f"amp {r['opt_level']} {r['dtype']}, FusedAdam, Fused{'LayerNorm' if norm == 'layer' else 'RMSNorm'}"
    return f"fp32, AdamW, nn.{'LayerNorm' if norm == 'layer' else 'RMSNorm'}"


def report(out: dict, directory: Path) -> None:
    runs = list(out["runs"].values())
    norm = out["config"]["norm"]
    rel = lambda k: f"{runs[0][k] / runs[1][k] - 1:+.2%}"
    ratio = lambda k: f"{runs[0][k] / runs[1][k]:.2f}x"
    rows = [
        ("", [LABELS[r["impl"]] for r in runs], "apex / PyTorch"),
        ("setup", [describe(r, norm) for r in runs], ""),
        ("precision chosen by", [r["why"] for r in runs], ""),
        ("attention", [r["attention"] for r in runs], ""),
        ("parameters", [f"{r['params'] / 1e6:.2f} M" for r in runs], ""),
        ("steps", [str(r["steps"]) for r in runs], ""),
        ("ranks x threads", [f"{out['world_size']} x {out['threads']}" for r in runs], ""),
        ("tokens/s", [f"{r['tokens_per_s']:,.0f}" for r in runs], lambda: ratio("tokens_per_s")),
        ("train time (s)", [f"{r['train_time_s']:.1f}" for r in runs], lambda: ratio("train_time_s")),
        (f"train loss (mean of last {runs[0]['train_tail']} steps)", [f"{r['final_train_loss']:.4f}" for r in runs],
         lambda: rel("final_train_loss")),
        ("final val loss", [f"{r['final_val_loss']:.4f}" for r in runs], lambda: rel("final_val_loss")),
        ("val loss drop", [f"{1 - r['final_val_loss'] / r['first_val_loss']:.0%} (from {r['first_val_loss']:.2f})"
                           for r in runs], ""),
        ("weights + optimizer state (MiB)", [f"{r['state_mib']:.1f}" for r in runs], lambda: ratio("state_mib")),
    ]
    compare = len(runs) == 2
    table = [[name, *cells, (last() if callable(last) else last)] if compare else [name, *cells]
             for name, cells, last in rows[1:]]
    print(format_table(table, ["", *rows[0][1], rows[0][2]] if compare else ["", *rows[0][1]]))
    print(f"peak memory ({out['peak_memory_kind']}{', both runs' if compare else ''}): "
          f"{out['peak_memory_mib']:,.0f} MiB")
    if compare:
        print(f"speed ratio (tokens/s, apex / PyTorch): {out['speed_ratio']:.2f}x; "
              f"final val loss difference: {out['val_loss_rel_diff']:+.2%}")
        title = (f"apex {runs[0]['dtype']} runs at {out['speed_ratio']:.2f}x the speed of PyTorch fp32; "
                 f"final val loss differs by {out['val_loss_rel_diff']:+.2%}")
    else:
        title = f"byte-level GPT on the Python stdlib ({runs[0]['params'] / 1e6:.1f}M params, {runs[0]['dtype']})"
    plot = plot_losses(directory / ("compare.png" if compare else "loss.png"),
                       {f"{LABELS[r['impl']]} {r['dtype']}": r["history"] for r in runs}, title)
    print(f"loss curves: {plot}")
    if "sample" in out:
        print("sample (apex model, prompt 'def '):\n" + "-" * 60 + "\n" + out["sample"] + "\n" + "-" * 60)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    m.add_argument("--n-head", type=int, default=4, help="attention heads")
    m.add_argument("--n-embd", type=int, default=256, help="model width")
    m.add_argument("--block-size", type=int, default=128, help="context length in bytes")
    m.add_argument("--attention", choices=["auto", "sdpa", "math"], default="auto",
                   help="F.scaled_dot_product_attention or matmul + softmax (auto: the faster for the dtype)")
    m.add_argument("--norm", choices=["layer", "rms"], default="layer",
                   help="FusedLayerNorm or FusedRMSNorm (nn.LayerNorm / nn.RMSNorm with --impl torch)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (default: {STEPS_HALF} in a half type, {STEPS_FP32} in fp32, whose steps "
                        "take about twice as long on CPUs)")
    t.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=50, help="linear warm-up steps, then cosine decay")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of the matrices")
    t.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    t.add_argument("--seed", type=int, default=1337, help="initial weights and batches")
    t.add_argument("--eval-interval", type=int, default=50, help="steps between validations")
    t.add_argument("--eval-batches", type=int, default=8, help="fixed validation batches")
    t.add_argument("--data-mb", type=float, default=0.0, help="use only the first N MiB of source (0: all)")
    t.add_argument("--sample-len", type=int, default=300, help="bytes of generated text at the end")
    r = p.add_argument_group("precision and hardware")
    r.add_argument("--impl", choices=["apex", "torch"], default="apex",
                   help="apex (amp + fused optimizer + fused norm) or the plain PyTorch fp32 baseline")
    r.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"], default=None,
                   help="apex.amp opt_level (default: O1 in a half type, O0 in fp32)")
    r.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="compute dtype: auto is a half type where the hardware has it (bf16 on CPUs with "
                        "AVX512-BF16 or AMX, fp16 on GPUs) and fp32 (amp O0) elsewhere")
    add_runtime_args(r)
    o = p.add_argument_group("outputs and checkpoints")
    o.add_argument("--out", default="runs/train_gpt", help="directory for metrics.json and the loss plot")
    o.add_argument("--compare", action="store_true",
                   help="train apex and the fp32 PyTorch baseline side by side (same seed, same batches, "
                        "steps interleaved) and compare speed and loss")
    o.add_argument("--save", metavar="DIR",
                   help="write a checkpoint to DIR every --save-every steps and at the end")
    o.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    o.add_argument("--resume", metavar="DIR", help="continue from the checkpoint in DIR (keeps saving there)")
    o.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop at STEP as if interrupted (the schedule still spans --steps)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.compare and (args.save or args.resume):
        p.error("--compare does not checkpoint; drop --save/--resume")
    if args.dtype == "fp32" and args.opt_level not in (None, "O0"):
        p.error(f"--dtype fp32 computes in fp32: it goes with --opt-level O0, not {args.opt_level}")
    if args.dtype in ("bf16", "fp16") and args.opt_level == "O0":
        p.error(f"--opt-level O0 computes in fp32: drop --dtype {args.dtype} or pick O1/O2/O3")
    require_positive(p, args, ("steps",) if args.steps is not None else ())
    require_positive(p, args, ("batch_size", "eval_interval", "eval_batches", "n_layer", "n_head",
                               "n_embd", "block_size"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    info = setup_distributed(args.device, args.dist_timeout)
    try:
        if args.steps is None:
            args.steps = default_steps(args, info.device)
        threads = set_cpu_threads(args.threads, info) if info.device.type == "cpu" else 0
        if info.is_main:
            what = "apex vs PyTorch fp32, step for step" if args.compare else args.impl
            print(f"train_gpt: {what} on {info.device}, {info.world_size} rank(s) x "
                  f"{threads or torch.get_num_threads()} thread(s), {args.steps} steps", flush=True)
        t0 = time.perf_counter()
        try:
            out = train(args, info)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        out["wall_time_s"] = time.perf_counter() - t0
        same = True
        for run in out["runs"].values():
            checks = run["checksums"]
            if info.distributed:
                same &= len(set(checks)) == 1
                print(f"rank {info.rank}: parameter checksum {checks[info.rank]} ({run['impl']})", flush=True)
        if info.is_main:
            if info.distributed:
                print(f"all {info.world_size} ranks have identical parameters" if same
                      else "error: the ranks' parameters differ")
            directory = Path(args.out)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "metrics.json").write_text(json.dumps(out, indent=1))
            if out["finished"]:
                report(out, directory)
            else:
                where = args.save or args.resume
                print(f"stopped at step {out['steps']} of {args.steps}"
                      + (f"; resume with --resume {where}" if where else ""))
        return 0 if same else 3
    finally:
        cleanup_distributed(info, ok=sys.exc_info()[0] is None)


if __name__ == "__main__":
    sys.exit(main())
