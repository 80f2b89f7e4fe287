"""Train a small CNN with batch norm on scikit-learn's bundled handwritten digits, with apex.

Nothing to download: ``sklearn.datasets.load_digits`` ships 1,797 8x8 images of the digits 0-9.

apex pieces used:
  * ``apex.amp`` at opt_level O2: the model runs in the half type (bf16 on CPUs, fp16 on GPUs) with batch norm
    kept in fp32 and fp32 master weights inside the optimizer;
  * ``apex.optimizers.FusedSGD`` (momentum, weight decay), wrapped in ``apex.parallel.LARC`` with ``--larc``;
  * ``apex.parallel.convert_syncbn_model`` + ``apex.parallel.DistributedDataParallel`` when started with
    ``torchrun --nproc_per_node N``: batch-norm statistics are merged across ranks (Gloo on CPUs, NCCL on
    GPUs). Every collective times out after ``--dist-timeout`` seconds, so a dead or hung rank makes the
    others fail with PyTorch's timeout error instead of waiting forever.

Examples::

    python examples/train_digits.py
    python examples/train_digits.py --larc
    torchrun --nproc_per_node 2 examples/train_digits.py
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from apex import amp
from apex.optimizers import FusedSGD
from apex.parallel import LARC, convert_syncbn_model
from apex.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    DistInfo,
    HelpFormatter,
    add_runtime_args,
    cleanup_distributed,
    format_table,
    gather_checksums,
    require_positive,
    set_cpu_threads,
    setup_distributed,
)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as (N, 1, 8, 8) floats in [0, 1]; a fixed, seeded 80/20 train/test split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    tr, te = perm[:n_train], perm[n_train:]
    return x[tr], y[tr], x[te], y[te]


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()

        def conv_bn(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True))

        self.features = nn.Sequential(conv_bn(1, width), conv_bn(width, width), nn.MaxPool2d(2),
                                      conv_bn(width, 2 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    model.eval()
    pred = torch.cat([model(xb.to(device)).argmax(1).cpu() for xb in x.split(256)])
    model.train()
    return (pred == y).float().mean().item()


def train(args, info: DistInfo) -> dict:
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = DigitsCNN(args.width)
    if info.distributed:
        model = convert_syncbn_model(model)  # batch statistics over the global batch, not each rank's share
    model = model.to(info.device)
    optimizer = FusedSGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    if args.larc:
        # Apex's amp accepts a LARC-wrapped optimizer: wrap first, then initialize.
        optimizer = LARC(optimizer, trust_coefficient=args.trust_coefficient, clip=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    if info.distributed:
        model = DDP(model)

    n = len(y_train)
    steps_per_epoch = max(1, n // (args.batch_size * info.world_size))
    total_steps = args.epochs * steps_per_epoch
    history = []
    t0 = time.perf_counter()
    bar = tqdm(range(args.epochs), disable=not info.is_main or args.no_progress, unit="epoch",
               file=sys.stderr)
    step = 0
    for epoch in bar:
        # Every rank draws the same permutation and takes its own slice of each global batch.
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        running = torch.zeros(2, dtype=torch.float64)
        for i in range(steps_per_epoch):
            lo = (i * info.world_size + info.rank) * args.batch_size
            idx = perm[lo:lo + args.batch_size]
            xb, yb = x_train[idx].to(info.device), y_train[idx].to(info.device)
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))  # cosine decay over the run
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = F.cross_entropy(model(xb).float(), yb)
            optimizer.zero_grad(set_to_none=True)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            running += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
            step += 1
        acc = accuracy(model, x_test, y_test, info.device)
        history.append((epoch + 1, (running[0] / running[1]).item(), acc))
        bar.set_postfix(loss=f"{history[-1][1]:.3f}", test_acc=f"{acc:.1%}")
    elapsed = time.perf_counter() - t0
    raw = model.module if hasattr(model, "module") else model
    return {"history": history, "time_s": elapsed, "steps": step, "test_accuracy": history[-1][2],
            "checksums": gather_checksums(raw, info)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--epochs", type=int, default=6, help="passes over the training images")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank and step")
    p.add_argument("--width", type=int, default=32, help="channels of the first convolutions")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate, then cosine decay")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="FusedSGD's weight decay")
    p.add_argument("--larc", action="store_true", help="wrap FusedSGD in apex.parallel.LARC")
    p.add_argument("--trust-coefficient", type=float, default=0.02, help="LARC's trust coefficient")
    p.add_argument("--opt-level", default="O2", help="apex.amp opt_level")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data split and batches")
    add_runtime_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    require_positive(p, args, ("epochs", "batch_size", "width"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    info = setup_distributed(args.device, args.dist_timeout)
    try:
        if info.device.type == "cpu":
            set_cpu_threads(args.threads, info)
        result = train(args, info)
        checks = result["checksums"]
        if info.distributed:
            print(f"rank {info.rank}: parameter checksum {checks[info.rank]}", flush=True)
        if info.is_main:
            rows = [[e, f"{loss:.4f}", f"{acc:.1%}"] for e, loss, acc in result["history"]]
            print(format_table(rows, ["epoch", "train loss", "test accuracy"]))
            print(f"{result['steps']} steps on {info.world_size} rank(s) in {result['time_s']:.1f} s "
                  f"(amp {args.opt_level}, FusedSGD{' + LARC' if args.larc else ''}"
                  f"{', SyncBatchNorm + DDP' if info.distributed else ''})")
            print(f"test accuracy: {result['test_accuracy']:.2%}")
            if info.distributed:
                print(f"all {info.world_size} ranks have identical parameters" if len(set(checks)) == 1
                      else f"error: ranks have different parameters: {checks}")
        return 0 if len(set(checks)) == 1 else 3
    finally:
        cleanup_distributed(info, ok=sys.exc_info()[0] is None)


if __name__ == "__main__":
    sys.exit(main())
