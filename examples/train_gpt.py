"""Train a small GPT on the Python standard library's own source code, with apex.

A byte-level language model (vocabulary of 256 bytes, no tokenizer, nothing to download): the text is every
``.py`` file of the standard library of the Python that runs this script (``sysconfig``), split into
training and validation files deterministically by a hash of each file's relative path.

apex pieces used:
  * ``apex.amp`` (opt_level O1: bf16 on CPUs, fp16 on GPUs by default) with ``amp.scale_loss``;
  * ``apex.optimizers.FusedAdam`` (AdamW mode);
  * ``apex.normalization.FusedLayerNorm`` (or ``FusedRMSNorm`` with ``--norm rms``);
  * ``apex.parallel.DistributedDataParallel`` when started with ``torchrun --nproc_per_node N``
    (Gloo on CPUs, NCCL on GPUs). Every collective times out after ``--dist-timeout`` seconds, so a rank
    that dies or hangs makes the others fail with PyTorch's timeout error instead of waiting forever.

Examples::

    python examples/train_gpt.py                      # ~2 minutes on 2 CPU cores
    python examples/train_gpt.py --compare            # apex bf16 + fused vs plain PyTorch fp32
    python examples/train_gpt.py --save runs/ckpt     # checkpoint every --save-every steps
    python examples/train_gpt.py --resume runs/ckpt   # continue exactly where it stopped
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 20

Outputs go to ``--out`` (default ``runs/train_gpt``): ``metrics.json`` and ``loss.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
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

from apex import amp
from apex.normalization import FusedLayerNorm, FusedRMSNorm
from apex.optimizers import FusedAdam
from apex.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    CheckpointError,
    DistInfo,
    cleanup_distributed,
    format_table,
    gather_checksums,
    load_checkpoint,
    peak_memory_mib,
    plot_losses,
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
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, norm: type[nn.Module]):
        super().__init__()
        self.ln1 = norm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = norm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.out = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, norm: type[nn.Module],
                 vocab: int = 256):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"--n-embd ({n_embd}) must be divisible by --n-head ({n_head})")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, norm) for _ in range(n_layer))
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


def make_model(args, impl: str) -> GPT:
    if impl == "torch":
        norm = nn.LayerNorm if args.norm == "layer" else nn.RMSNorm
    else:
        norm = FusedLayerNorm if args.norm == "layer" else FusedRMSNorm
    return GPT(args.n_layer, args.n_head, args.n_embd, args.block_size, norm)


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


def amp_dtype(args, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, args, info: DistInfo) -> float:
    """Mean loss over a fixed set of validation batches, shared out among the ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(info.rank, args.eval_batches, info.world_size):
        x, y = get_batch(val, args.batch_size, args.block_size, seed=10_000_019 + i)
        _, loss = model(x.to(info.device), y.to(info.device))
        total += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
    if info.distributed:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


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


def train(args, info: DistInfo) -> dict:
    impl = args.impl
    resume_state = read_resume_state(args)
    torch.manual_seed(args.seed)
    train_data, val_data, data_info = load_corpus(max_mb=args.data_mb)
    model = make_model(args, impl).to(info.device)
    n_params = sum(p.numel() for p in model.parameters())
    groups = param_groups(model, args.weight_decay)
    betas = (0.9, 0.95)
    use_amp = impl == "apex"
    if use_amp:
        optimizer = FusedAdam(groups, lr=args.lr, betas=betas, eps=1e-8, adam_w_mode=True)
        half = amp_dtype(args, info.device)
        amp_kwargs = {} if half == amp_dtype(argparse.Namespace(dtype="auto"), info.device) else \
            {"cast_model_type": half}
        model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0,
                                          **amp_kwargs)
    else:
        half = torch.float32
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=betas, eps=1e-8)
    raw_model = model

    history = {"train": [], "val": []}
    start = 0
    if resume_state is not None:
        state = resume_state
        try:
            raw_model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if use_amp:
                amp.load_state_dict(state["amp"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"cannot resume from {args.resume}: {exc}") from exc
        start, history = int(state["step"]), state["history"]
        if info.is_main:
            print(f"resumed from {args.resume} at step {start}/{args.steps}")

    if info.distributed:
        model = DDP(model)

    save_dir = args.save or args.resume

    def checkpoint(step: int) -> None:
        if not save_dir or not info.is_main:
            return
        save_checkpoint(save_dir, {
            "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
            "amp": amp.state_dict() if use_amp else None, "step": step,
            "config": vars(args), "history": history,
        })

    tokens_per_step = args.batch_size * args.block_size * info.world_size
    bar = tqdm(total=args.steps, initial=start, disable=not info.is_main or args.no_progress, unit="step",
               dynamic_ncols=True, desc=impl, file=sys.stderr)
    train_time, timed_steps, val_loss = 0.0, 0, float("nan")
    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    step = start
    for step in range(start, stop):
        if step % args.eval_interval == 0:
            val_loss = evaluate(model, val_data, args, info)
            history["val"].append((step, val_loss))
        t0 = time.perf_counter()
        x, y = get_batch(train_data, args.batch_size, args.block_size,
                         batch_seed(args.seed, step, info.rank, info.world_size))
        x, y = x.to(info.device), y.to(info.device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        _, loss = model(x, y)
        if use_amp:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            params = amp.master_params(optimizer)
        else:
            loss.backward()
            params = model.parameters()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_t = loss.detach().float()
        if info.distributed:
            dist.all_reduce(loss_t)
            loss_t /= info.world_size
        loss_v = loss_t.item()  # also waits for the step to finish, so the timing below is honest
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        dt = time.perf_counter() - t0
        if step > start:  # the first step pays one-off costs (allocator warm-up, kernel selection)
            train_time += dt
            timed_steps += 1
        history["train"].append((step, loss_v))
        if not math.isfinite(loss_v):
            raise FloatingPointError(f"training diverged at step {step}: loss {loss_v}")
        bar.set_postfix(loss=f"{loss_v:.3f}", val=f"{val_loss:.3f}",
                        tok_s=f"{tokens_per_step * timed_steps / max(train_time, 1e-9):,.0f}", refresh=False)
        bar.update(1)
        if args.save_every and (step + 1) % args.save_every == 0:
            checkpoint(step + 1)
    bar.close()
    done = stop if stop > start else start
    finished = done >= args.steps
    if finished and (not history["val"] or history["val"][-1][0] != done):
        history["val"].append((done, evaluate(model, val_data, args, info)))
    checkpoint(done)

    checksums = gather_checksums(raw_model, info)
    peak, peak_kind = peak_memory_mib(info.device)
    train_losses = [v for _, v in history["train"]]
    tail = train_losses[-args.eval_interval:] or [float("nan")]
    result = {
        "impl": impl, "dtype": str(half).replace("torch.", ""), "steps": done, "finished": finished,
        "params": n_params, "world_size": info.world_size, "threads": torch.get_num_threads(),
        "device": str(info.device), "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step * timed_steps / train_time if train_time else float("nan"),
        "train_time_s": train_time, "final_train_loss": sum(tail) / len(tail),
        "final_val_loss": history["val"][-1][1] if history["val"] else float("nan"),
        "first_val_loss": history["val"][0][1] if history["val"] else float("nan"),
        "peak_memory_mib": peak, "peak_memory_kind": peak_kind, "checksums": checksums,
        "data": data_info, "history": history, "config": vars(args),
    }
    if info.is_main and finished and args.sample_len > 0:
        text = raw_model.generate(b"def ", args.sample_len, seed=args.seed)
        result["sample"] = text.decode("utf-8", errors="replace")
    return result


MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "norm", "impl", "batch_size", "seed", "steps",
              "lr", "warmup", "weight_decay", "opt_level", "dtype", "data_mb")


# ----------------------------------------------------------------------------------------------------------
# Reporting.


def report(result: dict, out: Path) -> None:
    r = result
    drop = 1 - r["final_val_loss"] / r["first_val_loss"]
    rows = [
        ["implementation", "apex amp O1 + FusedAdam + Fused" + ("LayerNorm" if r["config"]["norm"] == "layer"
                                                               else "RMSNorm")
         if r["impl"] == "apex" else "PyTorch fp32 + AdamW + nn.LayerNorm"],
        ["compute dtype", r["dtype"]],
        ["parameters", f"{r['params'] / 1e6:.2f} M"],
        ["steps", r["steps"]],
        ["ranks x threads", f"{r['world_size']} x {r['threads']}"],
        ["tokens/s", f"{r['tokens_per_s']:,.0f}"],
        ["train time", f"{r['train_time_s']:.1f} s"],
        ["final train loss", f"{r['final_train_loss']:.4f}"],
        ["val loss first -> final",
         f"{r['first_val_loss']:.4f} -> {r['final_val_loss']:.4f} ({drop:.0%} lower)"],
        [f"peak memory ({r['peak_memory_kind']})", f"{r['peak_memory_mib']:,.0f} MiB"],
    ]
    print(format_table(rows, ["", "value"]))
    plot = plot_losses(out / "loss.png", {r["impl"]: r["history"]},
                       f"byte-level GPT on the Python stdlib ({r['params'] / 1e6:.1f}M params, {r['dtype']})")
    print(f"loss curves: {plot}")
    if "sample" in r:
        print("sample:\n" + "-" * 60 + "\n" + r["sample"] + "\n" + "-" * 60)


def run_compare(args, argv: list[str]) -> int:
    """Run apex and the plain PyTorch baseline one after the other, each in a fresh process (so memory
    peaks and warm-up are each run's own), then put them side by side."""
    out = Path(args.out)
    results = {}
    for impl in ("apex", "torch"):
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--impl", impl, "--out", str(out / impl)]
        print(f"== {impl}: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            print(f"error: the {impl} run failed with exit code {rc}", file=sys.stderr)
            return rc
        results[impl] = json.loads((out / impl / "metrics.json").read_text())
    a, t = results["apex"], results["torch"]
    speed = a["tokens_per_s"] / t["tokens_per_s"]
    dval = (a["final_val_loss"] - t["final_val_loss"]) / t["final_val_loss"]
    dtrain = (a["final_train_loss"] - t["final_train_loss"]) / t["final_train_loss"]
    fmt = lambda r: [f"{r['dtype']}", f"{r['tokens_per_s']:,.0f}", f"{r['train_time_s']:.1f}",
                     f"{r['final_train_loss']:.4f}", f"{r['final_val_loss']:.4f}",
                     f"{r['peak_memory_mib']:,.0f}"]
    print(format_table([["apex (amp O1, FusedAdam, Fused norm)", *fmt(a)],
                        ["PyTorch (fp32, AdamW, nn.LayerNorm)", *fmt(t)],
                        ["apex / PyTorch", "", f"{speed:.2f}x",
                         f"{a['train_time_s'] / t['train_time_s']:.2f}x",
                         f"{dtrain:+.2%}", f"{dval:+.2%}",
                         f"{a['peak_memory_mib'] / t['peak_memory_mib']:.2f}x"]],
                       ["run", "dtype", "tokens/s", "train s", "final train", "final val", "peak MiB"]))
    runs = {"apex " + a["dtype"]: a["history"], "PyTorch fp32": t["history"]}
    plot = plot_losses(out / "compare.png", runs,
                       f"apex {a['dtype']} is {speed:.2f}x the speed of PyTorch fp32; "
                       f"final val loss differs by {dval:+.2%}")
    summary = {"speed_ratio": speed, "val_loss_rel_diff": dval, "train_loss_rel_diff": dtrain}
    (out / "compare.json").write_text(json.dumps(summary, indent=2))
    print(f"speed ratio (tokens/s, apex / PyTorch): {speed:.2f}x; final val loss difference: {dval:+.2%}")
    print(f"loss curves: {plot}")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", type=int, default=4)
    m.add_argument("--n-head", type=int, default=4)
    m.add_argument("--n-embd", type=int, default=256)
    m.add_argument("--block-size", type=int, default=128)
    m.add_argument("--norm", choices=["layer", "rms"], default="layer",
                   help="FusedLayerNorm or FusedRMSNorm (nn.LayerNorm / nn.RMSNorm with --impl torch)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=500)
    t.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1337)
    t.add_argument("--eval-interval", type=int, default=50)
    t.add_argument("--eval-batches", type=int, default=8)
    t.add_argument("--data-mb", type=float, default=0.0, help="use only the first N MiB of source (0: all)")
    t.add_argument("--sample-len", type=int, default=300, help="bytes of generated text at the end")
    r = p.add_argument_group("precision and hardware")
    r.add_argument("--impl", choices=["apex", "torch"], default="apex",
                   help="apex (amp + fused optimizer + fused norm) or the plain PyTorch fp32 baseline")
    r.add_argument("--opt-level", default="O1", help="apex.amp opt_level")
    r.add_argument("--dtype", choices=["auto", "bf16", "fp16"], default="auto",
                   help="amp's half type: auto is bf16 on CPUs and fp16 on GPUs")
    r.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    r.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores / local ranks)")
    r.add_argument("--dist-timeout", type=float, default=120.0,
                   help="seconds before a collective waiting on a dead or hung rank fails")
    o = p.add_argument_group("outputs and checkpoints")
    o.add_argument("--out", default="runs/train_gpt", help="directory for metrics.json and the loss plot")
    o.add_argument("--compare", action="store_true",
                   help="run apex and the fp32 PyTorch baseline with the same seed and compare them")
    o.add_argument("--save", metavar="DIR",
                   help="write a checkpoint to DIR every --save-every steps and at the end")
    o.add_argument("--save-every", type=int, default=100)
    o.add_argument("--resume", metavar="DIR", help="continue from the checkpoint in DIR (keeps saving there)")
    o.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop at STEP as if interrupted (the schedule still spans --steps)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "eval_interval", "eval_batches", "n_layer", "n_head", "n_embd",
                 "block_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.compare:
        if "RANK" in os.environ:
            raise SystemExit("error: --compare runs two single-process trainings; start it with python, "
                             "not torchrun")
        strip = {"--compare"}
        child = [a for a in argv if a not in strip]
        # drop any --impl/--out the user gave: each side gets its own
        for flag in ("--impl", "--out"):
            while flag in child:
                i = child.index(flag)
                del child[i:i + 2]
            child = [a for a in child if not a.startswith(flag + "=")]
        return run_compare(args, child)

    info = setup_distributed(args.device, args.dist_timeout)
    try:
        threads = set_cpu_threads(args.threads, info) if info.device.type == "cpu" else 0
        if info.is_main:
            print(f"train_gpt: impl={args.impl} device={info.device} ranks={info.world_size} "
                  f"threads/rank={threads or torch.get_num_threads()}", flush=True)
        t0 = time.perf_counter()
        try:
            result = train(args, info)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        result["wall_time_s"] = time.perf_counter() - t0
        checks = result["checksums"]
        if info.distributed:
            same = len(set(checks)) == 1
            print(f"rank {info.rank}: parameter checksum {checks[info.rank]}", flush=True)
            if info.is_main:
                print(f"all {info.world_size} ranks have identical parameters" if same
                      else f"error: ranks have different parameters: {checks}")
            if not same:
                return 3
        if info.is_main:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.json").write_text(json.dumps(result, indent=1))
            if result["finished"]:
                report(result, out)
            else:
                where = args.save or args.resume
                print(f"stopped at step {result['steps']} of {args.steps}"
                      + (f"; resume with --resume {where}" if where else ""))
        return 0
    finally:
        cleanup_distributed(info)


if __name__ == "__main__":
    sys.exit(main())
