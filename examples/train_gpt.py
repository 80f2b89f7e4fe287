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
    that dies or hangs makes the others fail with PyTorch's timeout error instead of waiting forever;
  * ``apex.transformer`` with ``--tensor-parallel N --pipeline-parallel M`` (data parallel = the rest of the
    world): tensor-parallel layers, vocabulary-parallel embedding and cross-entropy, the 1F1B pipeline
    schedule over microbatches (``_gpt_parallel.py``, ``_gpt_parallel_run.py``). A run equals the
    one-process run whose ``--batch-size`` is ``--batch-size`` x data-parallel size, step for step.

Examples::

    python examples/train_gpt.py                      # a few minutes on 2 CPU cores
    python examples/train_gpt.py --compare            # apex (amp + fused) vs plain PyTorch fp32
    python examples/train_gpt.py --save runs/ckpt     # checkpoint every --save-every steps
    python examples/train_gpt.py --resume runs/ckpt   # continue exactly where it stopped
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 20
    torchrun --nproc_per_node 4 examples/train_gpt.py --tensor-parallel 2 --pipeline-parallel 2   # 3-D
    python examples/train_gpt.py --device cuda --dtype bf16   # GPUs: Triton kernels, fp16 unless told
    torchrun --nnodes 2 --node_rank R --master_addr HOST --master_port 29500 --nproc_per_node 8 \
        examples/train_gpt.py                                   # several machines (NCCL on GPUs)

Outputs go to ``--out`` (default ``runs/train_gpt``): ``metrics.json`` and ``loss.png`` (``compare.png`` with
``--compare``). ``--compare`` trains both models in one process, alternating steps on the same batches, so
that both see the same machine load and the speed ratio is fair on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    CheckpointError,
    DistInfo,
    HelpFormatter,
    add_runtime_args,
    cleanup_distributed,
    load_checkpoint,
    peak_memory_mib,
    require_positive,
    save_checkpoint,
    set_cpu_threads,
    setup_distributed,
)
from _gpt_model import (  # noqa: E402, F401  (the names tests and users reach through this script)
    GPT,
    attention_kind,
    batch_seed,
    get_batch,
    load_corpus,
    lr_at,
    make_model,
    param_groups,
)
from _gpt_parallel_run import ParallelRun, validate_layout  # noqa: E402
from _gpt_report import progress_text, report, write_progress  # noqa: E402
from _gpt_run import STEPS_FP32, STEPS_HALF, Run, choose_precision, default_steps  # noqa: E402, F401


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


def is_model_parallel(args) -> bool:
    return args.tensor_parallel > 1 or args.pipeline_parallel > 1


def train(args, info: DistInfo) -> dict:
    resume_state = read_resume_state(args)
    train_data, val_data, data_info = load_corpus(max_mb=args.data_mb)
    parallel = is_model_parallel(args)
    if parallel:
        runs = [ParallelRun(args, info)]
    else:
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
        postfix[run.impl] = progress_text(run, loss)

    def validate(step: int) -> None:
        for run in runs:
            if not run.history["val"] or run.history["val"][-1][0] != step:
                run.history["val"].append((step, run.evaluate(val_data)))
        if info.is_main:  # a run stopped with Ctrl-C keeps the metrics and plot of its last validation
            write_progress(Path(args.out), runs, step)

    for step in range(start, stop):
        if step % args.eval_interval == 0:
            validate(step)
        if parallel:
            x, y = runs[0].batch(train_data, step)
        else:
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
    # "first_step": where this process began (a resumed run's speed covers only the steps it ran).
    out = {"runs": {run.impl: run.result(stop) for run in runs}, "steps": stop, "first_step": start,
           "finished": stop >= args.steps,
           "world_size": info.world_size, "threads": torch.get_num_threads(), "device": str(info.device),
           "tokens_per_step": args.batch_size * args.block_size * (runs[0].dp if parallel else info.world_size),
           "peak_memory_mib": peak, "peak_memory_kind": peak_kind, "data": data_info, "config": vars(args)}
    if args.compare:
        a, t = out["runs"]["apex"], out["runs"]["torch"]
        out["speed_ratio"] = a["tokens_per_s"] / t["tokens_per_s"]
        out["val_loss_rel_diff"] = (a["final_val_loss"] - t["final_val_loss"]) / t["final_val_loss"]
        out["train_loss_rel_diff"] = (a["final_train_loss"] - t["final_train_loss"]) / t["final_train_loss"]
    if parallel:
        runs[0].close()
    elif info.is_main and out["finished"] and args.sample_len > 0:
        text = runs[0].raw.generate(b"def ", args.sample_len, seed=args.seed)
        out["sample"] = text.decode("utf-8", errors="replace")
    return out



def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
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
    t.add_argument("--batch-size", type=int, default=16,
                   help="sequences per rank and step (per data-parallel replica with --tensor/--pipeline-parallel)")
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
    d = p.add_argument_group("model parallelism (torchrun; data parallel = world size / (tensor x pipeline))")
    d.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split heads, MLP and vocabulary over N ranks (apex.transformer.tensor_parallel)")
    d.add_argument("--pipeline-parallel", type=int, default=1, metavar="M",
                   help="split the blocks into M stages trained with the 1F1B schedule")
    d.add_argument("--micro-batch-size", type=int, default=None,
                   help="rows per microbatch with --tensor/--pipeline-parallel (default: --batch-size / 2M)")
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
    if is_model_parallel(args) and (args.compare or args.save or args.resume):
        p.error("--tensor-parallel/--pipeline-parallel do not combine with --compare, --save or --resume")
    if is_model_parallel(args) and args.opt_level in ("O2", "O3"):
        p.error(f"--tensor-parallel/--pipeline-parallel compute in fp32 or with autocast (O1); --opt-level "
                f"{args.opt_level} is not supported there")
    if args.dtype == "fp32" and args.opt_level not in (None, "O0"):
        p.error(f"--dtype fp32 computes in fp32: it goes with --opt-level O0, not {args.opt_level}")
    if args.dtype in ("bf16", "fp16") and args.opt_level == "O0":
        p.error(f"--opt-level O0 computes in fp32: drop --dtype {args.dtype} or pick O1/O2/O3")
    require_positive(p, args, ("steps",) if args.steps is not None else ())
    require_positive(p, args, ("micro_batch_size",) if args.micro_batch_size is not None else ())
    require_positive(p, args, ("tensor_parallel", "pipeline_parallel"))
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
        if is_model_parallel(args):
            try:
                validate_layout(args, info.world_size)
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
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
                same &= run.get("replicas_identical", len(set(checks)) == 1)
                print(f"rank {info.rank}: parameter checksum {checks[info.rank]} ({run['impl']})", flush=True)
        if info.is_main:
            if info.distributed:
                if "parallel" in run:
                    lay = run["parallel"]
                    print(f"tensor {lay['tensor']} x pipeline {lay['pipeline']} x data {lay['data']}, "
                          f"{lay['microbatches']} microbatches of {lay['micro_batch_size']} ({lay['schedule']}): "
                          + ("the data-parallel replicas of every shard have identical parameters" if same
                             else "error: the data-parallel replicas' parameters differ"))
                else:
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
