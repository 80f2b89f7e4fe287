"""Tensor × pipeline × data-parallel training of ``train_gpt.py``'s GPT (``--tensor-parallel``,
``--pipeline-parallel``), wired from ``apex.transformer``: ``parallel_state`` for the groups, the microbatch
calculator, ``get_forward_backward_func`` (1F1B when there is more than one stage, no pipelining otherwise)
and, per step, the embedding-group and data-parallel gradient all-reduces, a global gradient-norm clip over
the model-parallel group and the optimizer step.

The global batch of a step is drawn as one batch of ``--batch-size × D`` rows with the one-process seed of
that step and split among the ``D`` data-parallel replicas, so a run equals the one-process run with
``--batch-size`` ``B × D``, step for step (up to fp32 rounding), whatever ``T``, ``P`` and the micro-batch size.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from _common import DistInfo, param_checksum
from _gpt_model import attention_kind, batch_seed, get_batch, lr_at, make_model, norm_class, param_groups
from _gpt_parallel import GPTStage, check_layout, load_from_full, stage_layers
from _gpt_run import choose_precision, finish_step, state_mib

from apex.optimizers import FusedAdam
from apex.transformer import parallel_state
from apex.transformer.amp import GradScaler
from apex.transformer.pipeline_parallel import utils as pp_utils
from apex.transformer.pipeline_parallel.schedules import get_forward_backward_func
from apex.transformer.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

EVAL_SEED = 10_000_019  # the one-process run's validation batches


def default_micro_batch_size(batch_size: int, pp: int) -> int:
    """The largest divisor of ``batch_size`` giving at least ``2 P`` microbatches (one with ``P = 1``): enough
    to keep the 1F1B bubble ``(P-1)/(m+P-1)`` at a third or less where the batch allows it."""
    want = 1 if pp == 1 else 2 * pp
    return max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and batch_size // d >= min(want, batch_size))


def counted_once(params: list) -> list:
    """The parameters whose elements this rank alone accounts for: not a tensor-parallel duplicate (norms
    count on tensor rank 0), not the last stage's copy of the tied embedding."""
    return [p for p in params if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False)]


def validate_layout(args, world_size: int) -> int:
    """The data-parallel size; ValueError naming the option that does not fit."""
    dp = check_layout(world_size, args.tensor_parallel, args.pipeline_parallel, args.n_layer, args.n_head)
    if args.micro_batch_size is not None and args.batch_size % args.micro_batch_size:
        raise ValueError(f"--batch-size ({args.batch_size}) is not divisible by --micro-batch-size "
                         f"({args.micro_batch_size})")
    return dp


class ParallelRun:
    """One model split over the ranks, trained step by step; the same interface as ``_gpt_run.Run``."""

    def __init__(self, args, info: DistInfo):
        self.args, self.info, self.impl = args, info, args.impl
        tp, pp = args.tensor_parallel, args.pipeline_parallel
        self.dp = validate_layout(args, info.world_size)
        if args.impl == "apex":
            self.dtype, _, self.why = choose_precision(args, info.device)
        else:
            self.dtype, self.why = torch.float32, "the plain PyTorch baseline"
        # autocast around each stage's forward (amp O1's policy), in the schedule; fp16 adds a loss scaler
        # whose inf checks agree over the model-parallel group.
        self.opt_level = "O0" if self.dtype == torch.float32 else "O1"
        self.use_amp = args.impl == "apex"
        self.attention = attention_kind(args, self.dtype, info.device)
        parallel_state.initialize_model_parallel(tp, pp)
        self.mbs = args.micro_batch_size or default_micro_batch_size(args.batch_size, pp)
        self.global_batch = args.batch_size * self.dp
        setup = (pp_utils.setup_microbatch_calculator if pp_utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
                 else pp_utils._reconfigure_microbatch_calculator)
        setup(info.rank, None, self.global_batch, self.mbs, self.dp)

        torch.manual_seed(args.seed)  # the one-process model's weights, then this rank's shards of them
        full = make_model(args, args.impl, self.dtype, torch.device("cpu"))
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.stage = GPTStage(args.n_layer, args.n_head, args.n_embd, args.block_size,
                              norm_class(args.impl, args.norm), self.attention,
                              pre_process=parallel_state.is_pipeline_first_stage(),
                              post_process=parallel_state.is_pipeline_last_stage(),
                              layers=stage_layers(args.n_layer, pp, pp_rank))
        load_from_full(self.stage, full)
        del full
        self.stage.to(info.device)
        self.params = list(self.stage.parameters())
        groups = param_groups(self.stage, args.weight_decay)
        if args.impl == "apex":
            self.optimizer = FusedAdam(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        self.scaler = GradScaler() if self.dtype == torch.float16 else None
        if self.scaler is not None:
            # Only the last stage scales a loss; the others need the scale to exist for unscale_().
            self.scaler.scale(torch.zeros((), device=info.device))
        self.schedule = get_forward_backward_func(None, pp)
        self.shape = (args.block_size, self.mbs, args.n_embd)
        count = torch.tensor([float(sum(p.numel() for p in counted_once(self.params)))], device=info.device)
        dist.all_reduce(count, group=parallel_state.get_model_parallel_group())
        self.n_params = int(count.item())
        self.history: dict[str, list] = {"train": [], "val": []}
        self.train_time, self.timed_steps = 0.0, 0

    # ------------------------------------------------------------------------------------------------------
    def batch(self, data: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's rows of the global batch of ``step`` (the one-process run's batch of that step)."""
        return self._rows(*get_batch(data, self.global_batch, self.args.block_size,
                                     batch_seed(self.args.seed, step, 0, 1)))

    def _rows(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d, b = parallel_state.get_data_parallel_rank(), self.args.batch_size
        return x[d * b:(d + 1) * b].to(self.info.device), y[d * b:(d + 1) * b].to(self.info.device)

    @staticmethod
    def _forward_step(batch, model):
        x, y = batch
        out = model(x, y)
        return out, lambda losses: (losses.mean(), losses.detach().mean())

    def _run_schedule(self, x: torch.Tensor, y: torch.Tensor, forward_only: bool) -> torch.Tensor:
        """The mean loss of the global batch, on every rank."""
        losses = self.schedule(self._forward_step, [x, y], self.stage, forward_only=forward_only,
                               tensor_shape=self.shape, dtype=self.dtype, grad_scaler=self.scaler,
                               disable_autocast=self.dtype == torch.float32)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.info.device)
        loss = loss.float().reshape(1)
        if parallel_state.is_pipeline_last_stage():
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss /= self.dp
        dist.broadcast(loss, parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
        return loss

    def _reduce_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:  # a parameter this step did not reach still takes part in the collectives
                p.grad = torch.zeros_like(p)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 and (
                parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()):
            dist.all_reduce(self.stage.embedding_weight().grad, group=parallel_state.get_embedding_group())
        if self.dp > 1:
            grads = [p.grad for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.dp)
            dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
            for g, f in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(f.view_as(g))

    def _clip(self, max_norm: float) -> None:
        """``clip_grad_norm_`` over the whole model: each parameter's square sum counted once (tensor-parallel
        duplicates and the tied embedding's last-stage copy left out), summed over the model-parallel group."""
        mine = [p.grad for p in counted_once(self.params)]
        sq = torch.stack([g.float().square().sum() for g in mine]).sum() if mine else torch.zeros(())
        sq = sq.reshape(1).to(self.info.device)
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        for p in self.params:
            p.grad.mul_(coef.to(p.grad.dtype))

    def train_step(self, step: int, x: torch.Tensor, y: torch.Tensor, timed: bool) -> float:
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.args)
        loss = self._run_schedule(x, y, forward_only=False)
        self._reduce_gradients()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.args.grad_clip > 0:
            self._clip(self.args.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return finish_step(self, step, loss.item(), t0, timed)

    @torch.no_grad()
    def evaluate(self, val: torch.Tensor) -> float:
        """Mean loss over the one-process run's validation batches (each of the global batch size)."""
        self.stage.eval()
        total = 0.0
        for i in range(self.args.eval_batches):
            x, y = self._rows(*get_batch(val, self.global_batch, self.args.block_size, seed=EVAL_SEED + i))
            total += self._run_schedule(x, y, forward_only=True).item()
        self.stage.train()
        return total / self.args.eval_batches

    def tokens_per_s(self) -> float:
        tokens = self.global_batch * self.args.block_size
        return tokens * self.timed_steps / self.train_time if self.train_time else float("nan")

    def state_mib(self) -> float:
        """This rank's parameters and optimizer state, in MiB."""
        return state_mib(self.params, self.optimizer)

    def result(self, done: int) -> dict:
        """As ``Run.result``, with the layout; ``checksums`` are per rank (each rank holds a different shard),
        and ``replicas_identical`` says whether the data-parallel replicas of every shard agree."""
        h = self.history
        tail = [v for _, v in h["train"]][-self.args.eval_interval:] or [float("nan")]
        coord = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
        mine = (coord, param_checksum(self.stage))
        everyone: list = [None] * self.info.world_size
        dist.all_gather_object(everyone, mine)
        by_shard: dict = {}
        for c, s in everyone:
            by_shard.setdefault(tuple(c), set()).add(s)
        return {
            "impl": self.impl, "dtype": str(self.dtype).replace("torch.", ""), "attention": self.attention,
            "opt_level": self.opt_level, "why": self.why, "steps": done, "finished": done >= self.args.steps,
            "params": self.n_params, "tokens_per_s": self.tokens_per_s(), "train_time_s": self.train_time,
            "timed_steps": self.timed_steps, "final_train_loss": sum(tail) / len(tail), "train_tail": len(tail),
            "first_val_loss": h["val"][0][1] if h["val"] else float("nan"),
            "final_val_loss": h["val"][-1][1] if h["val"] else float("nan"),
            "state_mib": self.state_mib(), "checksums": [s for _, s in everyone],
            "replicas_identical": all(len(s) == 1 for s in by_shard.values()), "history": h,
            "parallel": {"tensor": self.args.tensor_parallel, "pipeline": self.args.pipeline_parallel,
                         "data": self.dp, "micro_batch_size": self.mbs,
                         "microbatches": pp_utils.get_num_microbatches(),
                         "schedule": self.schedule.__name__},
        }

    def close(self) -> None:
        parallel_state.destroy_model_parallel()
