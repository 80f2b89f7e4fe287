"""The transducer loss's PyTorch path: the anti-diagonal recursion over a padded lattice, vectorised over the
batch and over each diagonal (strided views, one update per diagonal), the gradient's coefficients, and the
host-side range checks of the lengths and labels (the PyTorch path's and a packed input's; the Triton path
checks a dense input's in its kernels). The op, its other checks and dispatch are in
:mod:`apex.ops.transducer_loss`."""

from __future__ import annotations

import torch

from apex.ops._dispatch import kept_per_key

Tensor = torch.Tensor
_NEG = float("-inf")

def _lattice(f_len, y_len, T, U):
    t = torch.arange(T, device=f_len.device).view(1, T, 1)
    u = torch.arange(U, device=f_len.device).view(1, 1, U)
    return t < f_len.view(-1, 1, 1), u <= y_len.view(-1, 1, 1), u < y_len.view(-1, 1, 1)


def _labels(label, B, U):
    lab = torch.zeros((B, U), dtype=torch.long, device=label.device)
    n = min(U, label.shape[1])
    lab[:, :n] = label[:, :n]
    return lab


def _gather(logp, lse, label, f_len, y_len, T, U, blank_idx, packed, acc):
    """Blank and label log-probabilities (``logp − lse``) on the (B, T, U) lattice, −inf outside the lengths."""
    B, V = f_len.shape[0], logp.shape[-1]
    t_ok, u_ok, l_ok = _lattice(f_len, y_len, T, U)
    valid = t_ok & u_ok
    lab = _labels(label, B, U).clamp_(0, V - 1)
    if packed:
        rows = torch.zeros((B, T, U), dtype=torch.long, device=logp.device)
        rows[valid] = torch.arange(logp.shape[0], device=logp.device)
        lpb = logp[rows, blank_idx].to(acc)
        lpl = logp[rows, lab.unsqueeze(1).expand(B, T, U)].to(acc)
        if lse is not None:
            lse = lse[rows]
    else:
        lpb = logp[..., blank_idx].to(acc)
        lpl = logp.gather(3, lab.view(B, 1, U, 1).expand(B, T, U, 1)).squeeze(3).to(acc)
    if lse is not None:
        lpb, lpl = lpb - lse, lpl - lse
    lpb = lpb.masked_fill_(~valid, _NEG)
    lpl = lpl.masked_fill_(~(valid & l_ok), _NEG)
    return lpb, lpl, valid, lab


def _padded(v, B, T, U):
    p = v.new_full((B, T + 2, U + 2), _NEG)
    p[:, 1:T + 1, 1:U + 1] = v
    return p.view(B, -1)


def _diagonals(T, U):
    """Per anti-diagonal n, the slice of the flattened (T+2)×(U+2) lattice holding its cells (t, n − t)."""
    W = U + 2
    for n in range(T + U - 1):
        t0, t1 = max(0, n - U + 1), min(n, T - 1)
        start = W + n + 1 + t0 * (W - 1)
        yield start, start + (t1 - t0) * (W - 1) + 1, W - 1


def _alpha_beta_torch(lpb, lpl, f_len, y_len):
    B, T, U = lpb.shape
    W = U + 2
    pb, pl = _padded(lpb, B, T, U), _padded(lpl, B, T, U)
    alpha = torch.full_like(pb, _NEG)
    alpha[:, W + 1] = 0.0
    beta = torch.full_like(pb, _NEG)
    # A path ends with the blank at (f_len − 1, y_len) into the virtual cell (f_len, y_len), where β = 0.
    term = ((f_len.long() + 1) * W + y_len.long() + 1).view(-1, 1)
    term_mask = torch.zeros(pb.shape, dtype=torch.bool, device=pb.device).scatter_(1, term, True)
    beta.scatter_(1, term, 0.0)
    diags = list(_diagonals(T, U))
    for lo, hi, st in diags[1:]:
        alpha[:, lo:hi:st] = torch.logaddexp(alpha[:, lo - W:hi - W:st] + pb[:, lo - W:hi - W:st],
                                             alpha[:, lo - 1:hi - 1:st] + pl[:, lo - 1:hi - 1:st])
    for lo, hi, st in reversed(diags):
        val = torch.logaddexp(beta[:, lo + W:hi + W:st] + pb[:, lo:hi:st],
                              beta[:, lo + 1:hi + 1:st] + pl[:, lo:hi:st])
        beta[:, lo:hi:st] = torch.where(term_mask[:, lo:hi:st], beta[:, lo:hi:st], val)
    return alpha.view(B, T + 2, U + 2), beta.view(B, T + 2, U + 2), pb.view(B, T + 2, U + 2), pl.view(B, T + 2, U + 2)


def _coefficients(alpha, beta, pb, pl, loss_grad):
    """Per lattice cell: lg·occupancy, lg·(blank-edge posterior), lg·(label-edge posterior), each (B, T, U)."""
    a, bt = alpha[:, 1:-1, 1:-1], beta[:, 1:-1, 1:-1]
    log_z = beta[:, 1, 1].view(-1, 1, 1)
    lg = loss_grad.to(alpha.dtype).view(-1, 1, 1)
    c_all = torch.exp(a + bt - log_z) * lg
    c_blank = torch.exp(a + pb[:, 1:-1, 1:-1] + beta[:, 2:, 1:-1] - log_z) * lg
    c_label = torch.exp(a + pl[:, 1:-1, 1:-1] + beta[:, 1:-1, 2:] - log_z) * lg
    return c_all, c_blank, c_label


def _out_of_range(x, label, f_len, y_len, batch_offset, max_f_len, packed_input) -> tuple[int, int]:
    """:func:`apex.ops.transducer_loss.check_args`'s range checks by the values' extremes: a packed input's,
    and a dense input's that failed the bounds (the reads find what is out of range, for the message)."""
    B, V = f_len.shape[0], x.shape[-1]
    # The lengths' extremes and those of the used labels in one host read (each int(t.min()) is a reduction
    # and, on a GPU, a sync). Unused label entries read as 0 (in range), so the extremes of all entries decide:
    # no boolean indexing (a nonzero and a sync on GPUs).
    extremes = [*f_len.aminmax(), *y_len.aminmax()]
    if label.shape[1]:
        unused = _positions(label.shape[1], label.device) >= y_len.to(label.device).unsqueeze(1)
        lab = label.masked_fill(unused, 0).aminmax()
        extremes += lab if label.device == f_len.device == y_len.device else (t.to(f_len.device) for t in lab)
    else:  # no label entries: y_len must be 0 (checked below), nothing to read
        extremes += extremes[:2]
    f_min, f_max, y_min, y_max, lo, hi = torch.stack(extremes).tolist()
    if f_min < 1:
        raise ValueError(f"f_len values must be at least 1, got {f_min}")
    if y_min < 0 or y_max > label.shape[1]:
        raise ValueError(f"y_len values must lie in [0, {label.shape[1]}] (the label length), got "
                         f"[{y_min}, {y_max}]")
    if packed_input:
        if batch_offset is None or max_f_len is None:
            raise ValueError("batch_offset and max_f_len are required when packed_input=True")
        T, U = int(max_f_len), y_max + 1
        expect = torch.cumsum(f_len.long() * (y_len.long() + 1), 0)
        if not isinstance(batch_offset, Tensor) or not torch.equal(batch_offset.long().cpu(), expect.cpu()):
            raise ValueError("batch_offset must equal cumsum(f_len * (y_len + 1))")
        if int(expect[-1]) != x.shape[0]:
            raise ValueError(f"packed x has {x.shape[0]} rows but the lengths need {int(expect[-1])}")
    else:
        if x.shape[0] != B:
            raise ValueError(f"x has batch size {x.shape[0]} but f_len has {B}")
        T, U = x.shape[1], x.shape[2]
        if y_max + 1 > U:
            raise ValueError(f"y_len + 1 must be at most x.size(2) = {U}, got {y_max + 1}")
    if f_max > T:
        raise ValueError(f"f_len values must be at most {'max_f_len' if packed_input else 'x.size(1)'} = {T}, "
                         f"got {f_max}")
    if y_max > 0 and (lo < 0 or hi >= V):
        used = label[~unused]
        raise ValueError(f"label values must lie in [0, {V}), got [{int(used.min())}, {int(used.max())}]")
    return T, U


def _in_bounds(label: Tensor, f_len: Tensor, y_len: Tensor, B: int, L: int, T: int, U: int, V: int) -> bool:
    """Whether ``1 ≤ f_len ≤ T``, ``0 ≤ y_len ≤ min(label length, U − 1)`` and the used labels (those before
    each row's ``y_len``) lie in ``[0, V)``: the checks of a dense input in a few small operators and one
    host read (``torch.equal``; a GPU synchronisation), the lengths and the labels clamped to their bounds at
    once and compared with themselves. Every label is tried first (no mask to build); only when one is out
    of range are the unused ones, which may hold anything (padding), masked and the values tried again."""
    values = torch.cat((f_len, y_len, label.reshape(-1)))
    lo, hi = _bounds(B, L, T, U, V, values.dtype, values.device)
    if torch.equal(values.clamp(lo, hi), values):
        return True
    if not L:
        return False
    unused = _positions(L, label.device, y_len.dtype) >= y_len.unsqueeze(1)  # (same dtypes: no promotion)
    values = torch.cat((f_len, y_len, label.masked_fill(unused, 0).view(-1)))
    return torch.equal(values.clamp(lo, hi), values)


@kept_per_key
def _bounds(B: int, L: int, T: int, U: int, V: int, dtype: torch.dtype, device: torch.device
            ) -> tuple[Tensor, Tensor]:
    """The lower and upper bounds of :func:`_in_bounds`'s values (B frame lengths, B label lengths, B·L
    labels), kept per sizes, dtype and device."""
    top = torch.iinfo(dtype).max  # (a bound past the dtype's range is no bound)
    lo = torch.tensor([1] * B + [0] * (B + B * L), dtype=dtype, device=device)
    hi = torch.tensor([min(T, top)] * B + [min(L, U - 1, top)] * B + [min(V - 1, top)] * (B * L), dtype=dtype,
                      device=device)
    return lo, hi


@kept_per_key
def _positions(n: int, device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """``arange(n)`` as a (1, n) row on ``device``, kept per (n, device, dtype): the label mask needs it every
    call."""
    return torch.arange(n, device=device, dtype=dtype).unsqueeze(0)
