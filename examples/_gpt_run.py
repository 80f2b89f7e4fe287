"""Precision choice and the one-process (or data-parallel) training run of ``train_gpt.py``: apex (amp +
FusedAdam + fused norm) or the plain PyTorch fp32 baseline."""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from _common import CheckpointError, DistInfo, gather_checksums
from _gpt_model import attention_kind, get_batch, lr_at, make_model, param_groups

from apex import _hardware, amp
from apex.optimizers import FusedAdam
from apex.parallel import DistributedDataParallel as DDP

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


def finish_step(run, step: int, value: float, t0: float, timed: bool) -> float:
    """The end of a training step of ``run`` (one-process or parallel): wait for the device, book the step's
    time, stop on divergence, log the loss."""
    if run.info.device.type == "cuda":
        torch.cuda.synchronize(run.info.device)
    if timed:
        run.train_time += time.perf_counter() - t0
        run.timed_steps += 1
    if not math.isfinite(value):
        raise FloatingPointError(f"{run.impl}: training diverged at step {step} (loss {value})")
    run.history["train"].append((step, value))
    return value


def state_mib(params, optimizer) -> float:
    """``params``, the optimizer's own parameters (amp's masters) and its state, each tensor once, in MiB."""
    tensors = {id(p): p for p in params}
    for group in optimizer.param_groups:
        tensors.update((id(p), p) for p in group["params"])
    for st in optimizer.state.values():
        tensors.update((id(t), t) for t in st.values() if torch.is_tensor(t))
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20


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
        return finish_step(self, step, loss_t.item(), t0, timed)  # .item() waits for the step: honest timing

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
        return state_mib(self.raw.parameters(), self.optimizer)

    def result(self, done: int) -> dict:
        h = self.history
        tail = [v for _, v in h["train"]][-self.args.eval_interval:] or [float("nan")]
        return {
            "impl": self.impl, "dtype": str(self.dtype).replace("torch.", ""), "attention": self.attention,
            "opt_level": self.opt_level, "why": self.why,
            "steps": done,
            "finished": done >= self.args.steps, "params": self.n_params, "tokens_per_s": self.tokens_per_s(),
            "train_time_s": self.train_time, "timed_steps": self.timed_steps,
            "final_train_loss": sum(tail) / len(tail), "train_tail": len(tail),
            "first_val_loss": h["val"][0][1] if h["val"] else float("nan"),
            "final_val_loss": h["val"][-1][1] if h["val"] else float("nan"),
            "state_mib": self.state_mib(), "checksums": gather_checksums(self.raw, self.info), "history": h,
        }
