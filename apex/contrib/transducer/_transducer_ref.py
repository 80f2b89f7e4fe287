"""Plain reference implementations of the transducer joint and loss (Apex's ``_transducer_ref``), used by
tests. The loss recursion runs in float64 with Python loops: slow, but obviously right."""

from __future__ import annotations

import math

import torch


def _lae(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log(math.exp(a - m) + math.exp(b - m))


def _lattices(lp, label, T, U, blank_idx):
    """α and β of one sequence (lists of lists of floats) from its (T, U+1, V) float64 log-probabilities."""
    blank = lp[:T, :U + 1, blank_idx].tolist()
    emit = [[lp[t, u, int(label[u])].item() for u in range(U)] for t in range(T)]
    alpha = [[-math.inf] * (U + 1) for _ in range(T)]
    beta = [[-math.inf] * (U + 1) for _ in range(T)]
    for t in range(T):
        for u in range(U + 1):
            if t == 0 and u == 0:
                alpha[t][u] = 0.0
                continue
            up = alpha[t - 1][u] + blank[t - 1][u] if t > 0 else -math.inf
            left = alpha[t][u - 1] + emit[t][u - 1] if u > 0 else -math.inf
            alpha[t][u] = _lae(up, left)
    for t in range(T - 1, -1, -1):
        for u in range(U, -1, -1):
            down = beta[t + 1][u] if t + 1 < T else (0.0 if u == U else -math.inf)
            right = beta[t][u + 1] + emit[t][u] if u < U else -math.inf
            beta[t][u] = _lae(down + blank[t][u], right)
    return alpha, beta


def transducer_loss_reference(x, label, f_len, y_len, blank_idx, loss_grad):
    """``(alpha, beta, x.grad, loss)``: loss in ``x``'s dtype; ``x.grad`` is set through autograd."""
    B, T, U, V = x.shape
    lp64 = torch.log_softmax(x.detach().double(), dim=-1)
    alpha = torch.zeros(B, T, U, dtype=torch.float64)
    beta = torch.zeros(B, T, U, dtype=torch.float64)
    dlp = torch.zeros(B, T, U, V, dtype=torch.float64)
    for b in range(B):
        tb, ub = int(f_len[b]), int(y_len[b])
        a, be = _lattices(lp64[b], label[b], tb, ub, blank_idx)
        alpha[b, :tb, :ub + 1] = torch.tensor(a, dtype=torch.float64)
        beta[b, :tb, :ub + 1] = torch.tensor(be, dtype=torch.float64)
        log_z, lg = be[0][0], float(loss_grad[b])
        for t in range(tb):
            for u in range(ub + 1):
                down = be[t + 1][u] if t + 1 < tb else (0.0 if u == ub else -math.inf)
                dlp[b, t, u, blank_idx] -= lg * math.exp(a[t][u] + lp64[b, t, u, blank_idx].item() + down - log_z)
                if u < ub:
                    k = int(label[b, u])
                    dlp[b, t, u, k] -= lg * math.exp(a[t][u] + lp64[b, t, u, k].item() + be[t][u + 1] - log_z)
    lp = torch.log_softmax(x.double(), dim=-1)
    lp.backward(dlp.to(x.device))
    loss = (-beta[:, 0, 0]).to(x.dtype).to(x.device)
    return alpha.to(x.device), beta.to(x.device), x.grad, loss


def transducer_joint_reference(f, g, h_grad, f_len, g_len, pack_output, relu, dropout, dropout_prob=0,
                               mask=None):
    """``(h, f.grad, g.grad)`` of the joint; the dense don't-care region is −1, as Apex's kernel writes it."""
    if dropout and mask is None:
        raise NotImplementedError("mask needs to be supplied to test dropout")
    h = f.unsqueeze(2) + g.unsqueeze(1)
    if relu:
        h = torch.relu(h)
    if dropout:
        h = h * mask / (1 - dropout_prob)
    h.backward(h_grad)
    B, T, U, H = h.shape
    valid = (torch.arange(T, device=h.device).view(1, T, 1) < f_len.view(-1, 1, 1).to(h.device)) & \
        (torch.arange(U, device=h.device).view(1, 1, U) < g_len.view(-1, 1, 1).to(h.device))
    h = h.detach()
    if not pack_output:
        return h.masked_fill(~valid.unsqueeze(-1), -1), f.grad, g.grad
    return h[valid], f.grad, g.grad
