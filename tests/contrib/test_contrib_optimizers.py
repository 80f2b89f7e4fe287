import inspect

import torch

from apex.optimizers import FusedLAMB


def test_contrib_fused_lamb_is_apex_fused_lamb_with_the_contrib_arguments():
    from apex.contrib.optimizers import FusedLAMB as ContribLAMB
    from apex.contrib.optimizers.fused_lamb import FusedLAMB as ContribLAMB2

    assert ContribLAMB is ContribLAMB2 is FusedLAMB
    # The contrib signature (Apex's apex/contrib/optimizers/fused_lamb.py) is a prefix of this one.
    names = list(inspect.signature(ContribLAMB).parameters)
    assert names[:11] == ["params", "lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad",
                          "adam_w_mode", "grad_averaging", "set_grad_none", "max_grad_norm"]
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    before = p.detach().clone()
    ContribLAMB([p], lr=1e-2).step()
    assert not torch.equal(p.detach(), before)
