"""One training step of a 4-stage pipeline (4 Gloo ranks of this machine, the non-interleaved 1F1B schedule
of ``apex.transformer``) against the same model in one process without pipelining
(``forward_backward_no_pipelining`` over the same microbatches), and the measured pipeline bubble.

The model is a stack of MLP blocks (``h -> 4h -> GELU -> h`` plus residual), ``BLOCKS_PER_STAGE`` per stage;
the last stage's loss is the mean square of its output. The benchmark process is rank 0 (stage 0) and
spawns ranks 1-3, which mirror each step (rank 0 broadcasts what runs next; the one-process step pays the
same small broadcast). Each rank gets a quarter of the machine's threads and the one-process baseline the
same count: with at least 4 free cores, the ideal ratio is ``(1 + bubble) / PP``-ish; on a machine with
fewer cores than ranks the stages share cores and the ratio shows that instead.

The bubble: on every stage, timers wrap the schedule's sends/receives (``p2p_communication``) and its
compute (``forward_step``/``backward_step``); a stage's idle fraction is ``1 - compute / step time``,
against the theoretical ``(PP - 1) / (m + PP - 1)`` of 1F1B with ``m`` microbatches.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks._harness import Case
from benchmarks._ranks import Ranks

PP = 4
# (hidden, sequence, micro-batch size, microbatches)
CONFIGS = [(256, 64, 4, 8)]
BLOCKS_PER_STAGE = 2
OURS, THEIRS, MEASURE = 1, 2, 3
MEASURED_STEPS = 3
_P2P = ("recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
        "send_backward_recv_forward")


class _Blocks(torch.nn.Module):
    """``n`` residual MLP blocks on ``[sequence, batch, hidden]``; a pipeline stage (``set_input_tensor``)."""

    def __init__(self, hidden: int, n: int, *, pre_process: bool, post_process: bool):
        super().__init__()
        self.fc1 = torch.nn.ModuleList(torch.nn.Linear(hidden, 4 * hidden) for _ in range(n))
        self.fc2 = torch.nn.ModuleList(torch.nn.Linear(4 * hidden, hidden) for _ in range(n))
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pre_process:
            x = self.input_tensor
        for a, b in zip(self.fc1, self.fc2):
            x = x + b(F.gelu(a(x)))
        return x


def _forward_step(batch, model):
    out = model(batch[0])
    return out, lambda y: (y.square().mean(), y.detach().square().mean())


class _Steps:
    def __init__(self, rank: int, cfg):
        from apex.transformer import parallel_state
        from apex.transformer.pipeline_parallel.utils import setup_microbatch_calculator

        hidden, seq, mbs, m = cfg
        parallel_state.initialize_model_parallel(1, PP)
        setup_microbatch_calculator(rank, None, mbs * m, mbs, 1)
        self.shape = (seq, mbs, hidden)
        torch.manual_seed(0)
        # Every rank builds the whole model so that stage r is the r-th quarter of rank 0's baseline.
        stages = [_Blocks(hidden, BLOCKS_PER_STAGE, pre_process=i == 0, post_process=i == PP - 1) for i in range(PP)]
        self.stage = stages[rank]
        self.full = _Blocks(hidden, PP * BLOCKS_PER_STAGE, pre_process=True, post_process=True) if rank == 0 else None
        if self.full is not None:
            with torch.no_grad():
                for i, s in enumerate(stages):
                    for j in range(BLOCKS_PER_STAGE):
                        self.full.fc1[i * BLOCKS_PER_STAGE + j].load_state_dict(s.fc1[j].state_dict())
                        self.full.fc2[i * BLOCKS_PER_STAGE + j].load_state_dict(s.fc2[j].state_dict())
        g = torch.Generator().manual_seed(1)
        # The batch is [microbatches x micro-batch, ...] along dim 0 for get_kth_microbatch; each microbatch
        # is then viewed as [sequence, micro-batch, hidden] by the stage (the rows are independent).
        self.batch = [torch.randn(m * mbs, seq, hidden, generator=g)]
        self.rank = rank
        self.gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(PP)]
        self.timers: dict[str, float] = defaultdict(float)

    def _fwd(self, batch, model):
        x = batch[0].transpose(0, 1) if batch is not None else None
        return _forward_step([x], model)

    def ours(self) -> None:
        from apex.transformer.pipeline_parallel.schedules import get_forward_backward_func

        for p in self.stage.parameters():
            p.grad = None
        fb = get_forward_backward_func(None, PP)
        fb(self._fwd, self.batch, self.stage, forward_only=False, tensor_shape=self.shape, dtype=torch.float32)

    def theirs(self) -> None:
        from apex.transformer import parallel_state
        from apex.transformer.pipeline_parallel.schedules.fwd_bwd_no_pipelining import forward_backward_no_pipelining

        for p in self.full.parameters():
            p.grad = None
        # The one-process model is the whole pipeline: this rank pretends to be a pipeline of one stage.
        parallel_state.set_pipeline_model_parallel_world_size(1)
        parallel_state.set_pipeline_model_parallel_rank(0)
        try:
            forward_backward_no_pipelining(self._fwd, self.batch, self.full, forward_only=False)
        finally:
            parallel_state.set_pipeline_model_parallel_world_size(None)
            parallel_state.set_pipeline_model_parallel_rank(None)

    def measure(self) -> torch.Tensor:
        """``[step, compute, communication]`` seconds, summed over MEASURED_STEPS 1F1B steps on this rank."""
        from apex.transformer.pipeline_parallel import p2p_communication
        from apex.transformer.pipeline_parallel.schedules import fwd_bwd_pipelining_without_interleaving as sched

        def timed(module, name, kind):
            fn = getattr(module, name)

            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.timers[kind] += time.perf_counter() - t0
            return fn, wrapper

        patches = [(p2p_communication, n, *timed(p2p_communication, n, "comm")) for n in _P2P]
        patches += [(sched, n, *timed(sched, n, "compute")) for n in ("forward_step", "backward_step")]
        self.timers.clear()
        try:
            for module, name, _, wrapper in patches:
                setattr(module, name, wrapper)
            t0 = time.perf_counter()
            for _ in range(MEASURED_STEPS):
                self.ours()
            step = time.perf_counter() - t0
        finally:
            for module, name, original, _ in patches:
                setattr(module, name, original)
        return torch.tensor([step, self.timers["compute"], self.timers["comm"]], dtype=torch.float64)

    def run(self, which: int) -> None:
        if which == OURS:
            self.ours()
        elif which == MEASURE:
            mine = self.measure()
            dist.all_gather(self.gathered, mine)
        elif which == THEIRS and self.rank == 0:  # the one-process baseline runs on rank 0 only
            self.theirs()

    def close(self) -> None:
        from apex.transformer import parallel_state

        parallel_state.destroy_model_parallel()


def _bubble(ranks: Ranks, m: int) -> dict:
    ranks.step(OURS)  # warm-up
    ranks.step(MEASURE)
    rows = [t.tolist() for t in ranks.steps.gathered]
    idle = [1.0 - compute / step for step, compute, _ in rows]
    comm = [c / step for step, _, c in rows]
    facts = {"microbatches": m, "stages": PP, "bubble_theory": (PP - 1) / (m + PP - 1),
             "bubble_measured_per_stage": [round(x, 4) for x in idle],
             "bubble_measured_mean": sum(idle) / PP, "p2p_fraction_per_stage": [round(x, 4) for x in comm],
             "threads_per_rank": max(1, ranks.threads // PP)}
    print(f"bench_pipeline: PP={PP}, m={m}: bubble {facts['bubble_measured_mean']:.1%} measured (per stage "
          f"{', '.join(f'{x:.1%}' for x in idle)}) vs {facts['bubble_theory']:.1%} theoretical",
          file=sys.stderr, flush=True)
    return facts


def _timed(cfg):
    ranks = Ranks("bench_pipeline", PP, _Steps, cfg)
    facts = _bubble(ranks, cfg[3])
    return (*ranks.timed(OURS, THEIRS), facts)


def cases():
    return [Case(f"PP=4 1F1B step h={h} s={s} mbs={mbs} m={m} ({BLOCKS_PER_STAGE} MLP blocks/stage)",
                 timed=lambda cfg=(h, s, mbs, m): _timed(cfg), torch_label="1 process, no pipelining",
                 repeats=5, warmup=1)
            for h, s, mbs, m in CONFIGS]
