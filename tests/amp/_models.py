"""Small deterministic models and data for the amp tests."""

import torch
import torch.nn as nn


def mlp(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 4))


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def mlp_data(n: int = 64, seed: int = 1, noise: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(12345))  # one task for every seed
    return x, (x @ w + noise * torch.randn(n, 4, generator=g)).argmax(1)


def cnn_data(n: int = 32, seed: int = 1, noise: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    a = x[:, 0].mean((1, 2)) + noise * torch.randn(n, generator=g) / 8
    b = x[:, 1].mean((1, 2)) + noise * torch.randn(n, generator=g) / 8
    return x, (a > 0).long() + 2 * (b > 0).long()


def make_optimizer(name: str, params, lr: float | None = None):
    if name == "SGD":
        return torch.optim.SGD(params, lr=lr or 0.05, momentum=0.9, weight_decay=1e-4)
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=lr or 1e-2, weight_decay=1e-2)
    if name == "FusedAdam":
        from apex.optimizers import FusedAdam

        return FusedAdam(params, lr=lr or 1e-2, weight_decay=1e-2)
    if name == "FusedLAMB":
        from apex.optimizers import FusedLAMB

        return FusedLAMB(params, lr=lr or 1e-2, weight_decay=1e-2)
    raise ValueError(name)


def apex_optimizer_available(name: str) -> bool:
    try:
        import apex.optimizers as optimizers

        getattr(optimizers, name)
    except (ImportError, AttributeError):
        return False
    return True


OPTIMIZERS = ["SGD", "AdamW", "FusedAdam", "FusedLAMB"]


def skip_if_unavailable(name: str):
    import pytest

    if name.startswith("Fused") and not apex_optimizer_available(name):
        pytest.skip(f"apex.optimizers.{name} is not importable in this build")
