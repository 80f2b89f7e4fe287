"""``from apex.contrib.clip_grad import clip_grad_norm_``, as in Apex."""

from apex.contrib.clip_grad.clip_grad import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
