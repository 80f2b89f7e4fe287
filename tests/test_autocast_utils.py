"""apex._autocast_utils: casting of arguments under autocast."""

from __future__ import annotations

import torch

from apex._autocast_utils import _cast_if_autocast_enabled, _get_autocast_dtypes, _get_current_dtype


def test_passthrough_without_autocast():
    x = torch.randn(3)
    args = (x, 2, "s")
    out = _cast_if_autocast_enabled(*args)
    assert out == args and out[0] is x
    assert _get_current_dtype() == torch.float
    assert torch.half in _get_autocast_dtypes()


def test_cpu_autocast_casts_floating_tensors_only():
    x, i, d = torch.randn(2, 3), torch.arange(3), torch.randn(2, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            out = _cast_if_autocast_enabled(x, [x, (x,)], {"k": x}, i, d, 0.5, None)
            assert _get_current_dtype() == dtype
        assert out[0].dtype == dtype and out[1][0].dtype == dtype and out[1][1][0].dtype == dtype
        assert isinstance(out[1], list) and isinstance(out[1][1], tuple)
        assert out[2]["k"].dtype == dtype
        assert out[3] is i and out[4] is d and out[5] == 0.5 and out[6] is None  # like torch: fp64 kept
        torch.testing.assert_close(out[0].float(), x, rtol=1e-2, atol=1e-2)
