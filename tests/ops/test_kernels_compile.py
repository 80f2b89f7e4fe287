"""Every Triton kernel compiles for real GPU targets (NVIDIA sm_90, AMD gfx942), not only under the
interpreter, with its shared memory within the target's limit.

``benchmarks/compile_kernels.py`` (``apex.testing.triton_compile.check``) runs every benchmark case's Triton
path on CPU tensors with each launch turned into an ahead-of-time compile (no GPU needed) and fails when a
kernel launched in ``apex/_kernels`` was not compiled. It runs in a subprocess: this process decorated the
kernels with the interpreter on.
"""

import os
import textwrap

import pytest

from tests._compiled import run_uninterpreted


@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])
def test_every_kernel_compiles_for_gpu_targets(target):
    pytest.importorskip("triton")
    # (Triton 3.4's AMD backend has no linker of its own: it needs ROCm's, or TRITON_HIP_LLD_PATH; then it skips)
    proc = run_uninterpreted(["benchmarks/compile_kernels.py", "--target", target, "--no-timed"], timeout=900)
    assert f"{target}:" in proc.stdout and "kernels compiled" in proc.stdout


def test_compile_check_reports_what_the_interpreter_accepts(tmp_path):
    # A kernel the interpreter runs happily but no GPU can: a 256x256 fp32 tile pair for tl.dot needs far
    # more shared memory than one block has. The checker must see it (and must refuse the interpreter).
    pytest.importorskip("triton")
    (tmp_path / "big_tile.py").write_text(textwrap.dedent('''
        import torch, triton, triton.language as tl

        @triton.jit
        def big(A, B, C, N: tl.constexpr):
            r = tl.arange(0, N)
            a = tl.load(A + r[:, None] * N + r[None, :])
            b = tl.load(B + r[:, None] * N + r[None, :])
            tl.store(C + r[:, None] * N + r[None, :], tl.dot(a, b))

        def launch():
            x = torch.randn(256, 256)
            big[(1,)](x, x, torch.empty_like(x), N=256)
    '''))
    script = textwrap.dedent('''
        import big_tile
        from apex.testing.triton_compile import SHARED_LIMIT, compile_only
        with compile_only("cuda:90") as rec:
            big_tile.launch()
        (c,) = rec.compiled
        print(c.kernel, c.shared, c.shared > SHARED_LIMIT["cuda:90"])
    ''')
    proc = run_uninterpreted(["-c", script], cwd=tmp_path, timeout=300)
    name, shared, over = proc.stdout.split()
    assert name == "big_tile.big" and int(shared) > 0 and over == "True"


def test_compile_only_refuses_the_interpreter():
    from apex.testing.triton_compile import compile_only

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("this process does not run the interpreter")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"), compile_only("cuda:90"):
        pass
