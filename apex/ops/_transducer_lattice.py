"""The transducer loss's PyTorch path: the anti-diagonal recursion over a padded lattice, vectorised over the
batch and over each diagonal (strided views, one update per diagonal), and the gradient's coefficients. The
op, its checks and dispatch are in :mod:`apex.ops.transducer_loss`."""

from __future__ import annotations

import torch

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
