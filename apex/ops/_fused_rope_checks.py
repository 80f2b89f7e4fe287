"""Argument checks of :mod:`apex.ops.fused_rope`'s entry points: shapes, dtypes and devices of the input and
its tables (``sbhd``, cached ``cos``/``sin``, ``thd`` with ``cu_seqlens``, 2-D image), and the data-dependent
checks of ``cu_seqlens``' values (one host read).
"""

from __future__ import annotations

import torch

from apex._errors import AssertValueError, RuntimeTypeError, RuntimeValueError
from apex.ops._checks import member_set
from apex.ops._dispatch import _PLAIN
from apex.ops._norm import _same_device

Tensor = torch.Tensor


# A set: a dtype's membership by its hash (a tuple compares it with each entry in turn).
_FLOATS = member_set(torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------------------------- checks
# Apex checks these shapes and dtypes with TORCH_CHECK (RuntimeError) in its C++ entry points, and the 2-D
# wrapper's sequence length and table pairs with ``assert``: each error here is also the type Apex raised.
def _check_tensor(x: object, name: str, dim: int, floating: bool = True) -> Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim:
        raise RuntimeValueError(f"{name} must be a {dim}-D tensor, got shape {list(x.shape)}")
    if floating and x.dtype not in _FLOATS:
        raise RuntimeTypeError(f"{name} must be float32, float16, bfloat16 or float64, got {x.dtype}")
    return x


def _check_table(tab: object, name: str, t: Tensor, tname: str, rows: int, d: int, row_dim: int = 0,
                 exact: bool = True) -> int:
    """A ``[rows, 1, 1, R]`` (``row_dim=0``) or ``[1, ≥rows, 1, R]`` (``row_dim=1``) table; returns R.

    ``exact``: the table has exactly ``rows`` positions (``t``'s sequence length), else at least ``rows``.
    """
    _check_tensor(tab, name, 4)
    shape = tab.shape  # read once: each .size(i) costs about as much as .shape
    if shape[1 - row_dim] != 1 or shape[2] != 1:
        want = "[s, 1, 1, R]" if row_dim == 0 else "[1, H, 1, R]"
        raise RuntimeValueError(f"{name} must have shape {want}, got {list(shape)}")
    n = shape[row_dim]
    if exact and n != rows:
        raise RuntimeValueError(f"{name} has {n} positions but {tname} has sequence length {rows}: "
                                "they must be the same")
    if n < rows:
        raise RuntimeValueError(f"{name} has {n} positions, fewer than the {rows} needed")
    r = shape[3]
    if r > d or r % 2:
        raise RuntimeValueError(f"{name}'s last dim ({r}) must be even and at most {tname}'s head dim {d}")
    if not _same_device(tab, t):
        raise RuntimeValueError(f"{name} is on {tab.device} but {tname} is on {t.device}")
    return r


def _check_freqs_dtype(freqs: Tensor, t: Tensor) -> None:
    # Apex reads the angles as fp32 only; fp64 angles go with fp64 inputs, which compute in fp64 here.
    allowed = (torch.float32, torch.float64) if t.dtype == torch.float64 else (torch.float32,)
    if freqs.dtype not in allowed:
        raise RuntimeTypeError(f"freqs must be float32{' or float64' if len(allowed) == 2 else ''}, "
                               f"got {freqs.dtype}")


def _check_table_dtype(tab: Tensor, name: str, t: Tensor, tname: str) -> None:
    # Apex's kernels take cos/sin tables in fp32 or in the input's own dtype, nothing else.
    if tab.dtype not in (torch.float32, t.dtype):
        raise RuntimeTypeError(f"{name} must be float32 or {tname}'s dtype {t.dtype}, got {tab.dtype}")


def _check_pair(cos: Tensor, sin: Tensor, names: str, error: type[Exception] | None = None) -> None:
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise (error or RuntimeValueError)(f"{names} must have the same shape and dtype, got "
                                           f"{list(cos.shape)} {cos.dtype} and {list(sin.shape)} {sin.dtype}")


def check_sbhd(t: Tensor, freqs: Tensor, tname: str = "t") -> int:
    """Check an ``sbhd`` call; the rotary width ``R`` when both are plain tensors (the quick test passed: the
    caller need not ask again about subclasses, nor read the shape), else -1."""
    # The usual call (plain tensors, fp32 angles [s, 1, 1, R] on t's device) tested reading each attribute
    # once (~15k instructions for the checks below); anything else, or anything wrong, takes them (their errors).
    if type(t) in _PLAIN and type(freqs) in _PLAIN and freqs.dtype is torch.float32 and t.dtype in _FLOATS:
        sh, fs = t.shape, freqs.shape
        if (len(sh) == 4 and len(fs) == 4 and fs[0] == sh[0] and fs[1] == 1 and fs[2] == 1 and fs[3] <= sh[3]
                and not fs[3] % 2 and _same_device(freqs, t)):
            return fs[3]
    _check_tensor(t, tname, 4)
    shape = t.shape
    _check_table(freqs, "freqs", t, tname, shape[0], shape[3])
    _check_freqs_dtype(freqs, t)
    return -1


def check_cached(t: Tensor, cos_: Tensor, sin_: Tensor, tname: str = "t", names: tuple[str, str] = ("cos_", "sin_")
                 ) -> None:
    _check_tensor(t, tname, 4)
    shape = t.shape
    for name, tab in zip(names, (cos_, sin_)):
        _check_table(tab, name, t, tname, shape[0], shape[3])
        _check_table_dtype(tab, name, t, tname)
    _check_pair(cos_, sin_, " and ".join(names))


def check_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, tname: str = "t") -> None:
    _check_tensor(t, tname, 3)
    _check_tensor(cu_seqlens, "cu_seqlens", 1, floating=False)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise RuntimeTypeError(f"cu_seqlens must be an int32/int64 tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 1:
        raise RuntimeValueError("cu_seqlens must have at least one element (the offset of the first sequence)")
    if cu_seqlens.device != t.device:
        raise RuntimeValueError(f"cu_seqlens is on {cu_seqlens.device} but {tname} is on {t.device}")
    # freqs holds the positions of the longest sequence (checked against cu_seqlens' values at the launch).
    _check_table(freqs, "freqs", t, tname, 0, t.size(2), exact=False)
    _check_freqs_dtype(freqs, t)


def _check_cu_values(cu: Tensor, tokens: int, max_s: int) -> None:
    """Data-dependent checks of ``cu_seqlens`` (one host sync)."""
    c = cu.detach().to("cpu", torch.int64)
    if c.numel() > 1 and bool((c[1:] < c[:-1]).any()):
        raise RuntimeValueError(f"cu_seqlens must be non-decreasing, got {c.tolist()}")
    if int(c[0]) < 0 or int(c[-1]) > tokens:
        raise RuntimeValueError(f"cu_seqlens must lie in [0, {tokens}] (the tokens of t), got {c.tolist()}")
    longest = int((c[1:] - c[:-1]).max()) if c.numel() > 1 else 0
    if longest > max_s:
        raise RuntimeValueError(f"a sequence of cu_seqlens has {longest} tokens but freqs has only {max_s} "
                                "positions")


def check_2d(t: Tensor, img_h: int, img_w: int, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor,
             sin_w: Tensor, tname: str = "t") -> None:
    _check_tensor(t, tname, 4)
    if not (isinstance(img_h, int) and isinstance(img_w, int) and img_h > 0 and img_w > 0):
        raise AssertValueError(f"img_h and img_w must be positive ints, got {img_h!r} and {img_w!r}")
    if t.size(1) != img_h * img_w:
        raise AssertValueError(f"{tname}'s sequence length {t.size(1)} must equal img_h * img_w = {img_h * img_w}")
    for name, tab in (("cos_h", cos_h), ("sin_h", sin_h), ("cos_w", cos_w), ("sin_w", sin_w)):
        _check_tensor(tab, name, 4)
    _check_pair(cos_h, sin_h, "cos_h and sin_h", AssertValueError)
    _check_pair(cos_w, sin_w, "cos_w and sin_w", AssertValueError)
    d = t.size(3)
    if d % 2:
        raise RuntimeValueError(f"{tname}'s head dim must be even for 2-D RoPE, got {d}")
    for name, tab, rows in (("cos_h", cos_h, img_h), ("sin_h", sin_h, img_h), ("cos_w", cos_w, img_w),
                            ("sin_w", sin_w, img_w)):
        if _check_table(tab, name, t, tname, rows, d, row_dim=1, exact=False) != d // 2:
            raise RuntimeValueError(f"{name}'s last dim must be {tname}'s head dim / 2 = {d // 2}, got {tab.size(3)}")
        _check_table_dtype(tab, name, t, tname)
