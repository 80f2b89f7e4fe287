"""``apex.contrib.gpu_direct_storage.GDSFile`` (ordinary file I/O) and ``_apex_gpu_direct_storage``."""

from __future__ import annotations

import _apex_gpu_direct_storage
import numpy as np
import pytest
import torch

import apex.contrib.gpu_direct_storage as gds

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]


def _rand(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("modes", [("w", "r", "save_data", "load_data"),
                                   ("wn", "rn", "save_data_no_gds", "load_data_no_gds")])
def test_round_trip_in_place(tmp_path, dtype, modes):
    wmode, rmode, save, load = modes
    x = _rand((37, 5), dtype)
    path = str(tmp_path / "x.data")
    with gds.GDSFile(path, wmode) as f:
        getattr(f, save)(x)
    # Apex's format: the raw bytes, nothing else.
    raw = (tmp_path / "x.data").read_bytes()
    assert raw == x.view(torch.uint8).numpy().tobytes()
    y = _rand((37, 5), dtype)
    ptr = y.data_ptr()
    with gds.GDSFile(path, rmode) as f:
        getattr(f, load)(y)
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8)) and y.data_ptr() == ptr


def test_non_contiguous_tensors(tmp_path):
    base = torch.randn(6, 8, dtype=torch.bfloat16)
    x = base.t()  # non-contiguous: saved in logical order
    path = str(tmp_path / "t.data")
    with gds.GDSFile(path, "w") as f:
        f.save_data(x)
    y = torch.zeros(8, 6, dtype=torch.bfloat16)
    with gds.GDSFile(path, "r") as f:
        f.load_data(y)
    assert torch.equal(y, x)
    z = torch.zeros(6, 8, dtype=torch.bfloat16).t()  # non-contiguous destination, filled element-wise
    with gds.GDSFile(path, "r") as f:
        f.load_data(z)
    assert torch.equal(z, x)
    window = torch.zeros(60, dtype=torch.bfloat16)
    with gds.GDSFile(path, "r") as f:
        f.load_data(window[7:55])  # a contiguous view with a storage offset: only its bytes change
    assert torch.equal(window[7:55].view(8, 6), x) and not window[:7].any() and not window[55:].any()
    part = torch.zeros(16, 6, dtype=torch.bfloat16)[::2]
    with gds.GDSFile(path, "r") as f:
        f.load_data(part)
    assert torch.equal(part, x)


def test_parameter_requiring_grad_is_loaded(tmp_path):
    p = torch.nn.Parameter(torch.randn(9))
    src = torch.randn(9)
    path = str(tmp_path / "p.data")
    with gds.GDSFile(path, "w") as f:
        f.save_data(src)
    with gds.GDSFile(path, "r") as f:
        f.load_data(p)
    assert torch.equal(p.detach(), src) and p.requires_grad


def test_reads_apex_style_files(tmp_path):
    """A file written the way Apex's example does (linspace, raw fp32 bytes) loads here."""
    path = tmp_path / "1024.data"
    np.linspace(0, 1, 1024, dtype=np.float32).tofile(path)
    x = torch.empty(1024)
    with gds.GDSFile(str(path), "r") as f:
        f.load_data(x)
    assert torch.allclose(x, torch.linspace(0, 1, 1024))


def test_rewrite_truncates(tmp_path):
    path = str(tmp_path / "x.data")
    with gds.GDSFile(path, "w") as f:
        f.save_data(torch.randn(100))
    small = torch.randn(10)
    with gds.GDSFile(path, "w") as f:
        f.save_data(small)
    assert (tmp_path / "x.data").stat().st_size == 40


def test_misuse_is_an_error_and_changes_nothing(tmp_path):
    path = str(tmp_path / "x.data")
    x = torch.randn(4)
    with pytest.raises(ValueError, match="mode"):
        with gds.GDSFile(path, "a"):
            pass
    assert not (tmp_path / "x.data").exists()
    with pytest.raises(TypeError, match="filename"):
        gds.GDSFile(3, "w").__enter__()
    with gds.GDSFile(path, "w") as f:
        with pytest.raises(RuntimeError, match="mode 'w'"):
            f.load_data(x)
        with pytest.raises(RuntimeError, match="mode 'w'"):
            f.save_data_no_gds(x)
        with pytest.raises(TypeError, match="tensor"):
            f.save_data([1.0])
        f.save_data(x)
    with pytest.raises(RuntimeError, match="not open"):
        f.save_data(x)
    big = torch.randn(5)
    before = big.clone()
    with gds.GDSFile(path, "r") as f:
        with pytest.raises(RuntimeError, match="holds 16 bytes"):
            f.load_data(big)
        with pytest.raises(TypeError, match="dense"):
            f.load_data(torch.empty(4, device="meta"))
    assert torch.equal(big, before)
    h = _apex_gpu_direct_storage._GDSFile(path, "r")
    with pytest.raises(RuntimeError, match="already open"):
        h.open(path, "r")
    h.close()
    h.close()  # closing twice is harmless


def test_compat_class_with_default_constructor(tmp_path):
    path = str(tmp_path / "y.data")
    h = _apex_gpu_direct_storage._GDSFile()
    h.open(path, "wn")
    x = torch.randn(3, 3, dtype=torch.float16)
    h.save_data_no_gds(x)
    h.close()
    h.open(path, "rn")
    y = torch.empty(3, 3, dtype=torch.float16)
    h.load_data_no_gds(y)
    h.close()
    assert torch.equal(x, y)
