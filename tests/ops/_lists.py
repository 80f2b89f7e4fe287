"""Ragged tensor lists shared by the multi-tensor op tests."""

import torch

SIZES = (1, 7, 4097, 65537)
CHUNK_SIZES = (333, 2048 * 32, 33333)


def ragged(dtype, sizes=SIZES, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * scale).to(dtype) for n in sizes]


def mixed(seed=0):
    """A list mixing dtypes and shapes, including a 3-D tensor."""
    g = torch.Generator().manual_seed(seed)
    specs = [((5,), torch.float32), ((3, 17, 9), torch.float16), ((4097,), torch.bfloat16), ((2, 33), torch.float32)]
    return [torch.randn(*shape, generator=g).to(dt) for shape, dt in specs]


def flag():
    return torch.zeros(1, dtype=torch.int32)
