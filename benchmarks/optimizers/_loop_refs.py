"""Per-parameter-loop implementations of LAMB and NovoGrad (what one writes without multi-tensor ops, as
timm's ``Lamb`` or the NovoGrad of OpenSeq2Seq do): the CPU baselines of the optimizer benchmarks."""

from __future__ import annotations

import math

import torch


class LoopLAMB:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd, self.max_norm = lr, betas, eps, weight_decay, max_grad_norm
        self.state = {}
        self.step_count = 0

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        b1, b2 = self.betas
        grads = [p.grad for p in self.params]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        clip = torch.where(total > self.max_norm, total / self.max_norm, torch.ones_like(total))
        bc1, bc2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        for p in self.params:
            st = self.state.setdefault(p, {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})
            g = p.grad / clip
            st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            u = (st["exp_avg"] / bc1) / ((st["exp_avg_sq"] / bc2).sqrt_().add_(self.eps))
            u.add_(p, alpha=self.wd)
            pn, un = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
            ratio = torch.where((pn > 0) & (un > 0), pn / un, torch.ones_like(pn))
            p.sub_(u * (self.lr * ratio))


class LoopNovoGrad:
    def __init__(self, params, lr=1e-3, betas=(0.95, 0.98), eps=1e-8, weight_decay=0.0):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.state = {}
        self.step_count = 0

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.step_count, math.sqrt(1 - b2 ** self.step_count)
        for p in self.params:
            g = p.grad
            n = torch.linalg.vector_norm(g)
            if p not in self.state:
                self.state[p] = {"exp_avg": torch.zeros_like(p), "norm": n.clone()}
            st = self.state[p]
            st["norm"] = torch.sqrt(b2 * st["norm"] ** 2 + (1 - b2) * n * n)
            st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            d = st["norm"] / bc2 + self.eps
            u = st["exp_avg"] / bc1 / d
            if self.wd:
                u.add_(p, alpha=self.wd)
            p.sub_(u, alpha=self.lr)
