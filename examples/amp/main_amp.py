"""Mixed-precision training with apex.amp on CPU: an MLP on scikit-learn's bundled digits (no download).

    python examples/amp/main_amp.py --opt-level O1                 # bf16 autocast, dynamic loss scaling
    python examples/amp/main_amp.py --opt-level O2 --half fp16     # fp16 model, fp32 master weights
    python examples/amp/main_amp.py --opt-level O2 --epochs 4 --save ckpt.pt
    python examples/amp/main_amp.py --opt-level O2 --epochs 8 --resume ckpt.pt   # Apex's checkpoint recipe

The amp lines are the three of Apex's README: ``from apex import amp``, ``amp.initialize`` and
``with amp.scale_loss(...)``; the checkpoint holds ``model``, ``optimizer`` and ``amp.state_dict()``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from apex import amp

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_digits():
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def evaluate(model, x, y) -> tuple[float, float]:
    model.eval()
    with torch.no_grad(), amp.disable_casts():
        logits = model(x).float()
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--half", default="bf16", choices=sorted(HALF), help="half type (bf16 is the CPU default)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save", default=None, help="write a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="resume from a checkpoint written by --save")
    p.add_argument("--verbosity", type=int, default=1)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    (x_train, y_train), (x_test, y_test) = load_digits()
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, half_dtype=HALF[args.half],
                                      verbosity=args.verbosity)
    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        start_epoch = checkpoint["epoch"]

    n = len(x_train)
    test_loss, test_acc = evaluate(model, x_test, y_test)
    for epoch in range(start_epoch, args.epochs):
        g = torch.Generator().manual_seed(epoch)
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - args.batch_size + 1, args.batch_size):
            idx = perm[i:i + args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        test_loss, test_acc = evaluate(model, x_test, y_test)
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        print(f"epoch {epoch + 1}: test loss {test_loss:.4f}  accuracy {test_acc:.3f}  loss scale {scale:g}")

    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict(),
                    "epoch": args.epochs}, args.save)
    return {"test_loss": test_loss, "test_acc": test_acc, "model": model}


if __name__ == "__main__":
    main()
