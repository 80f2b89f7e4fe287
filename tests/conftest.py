"""Test configuration: Triton kernels run under the interpreter on this CPU-only machine.

``TRITON_INTERPRET`` must be set before any module that defines ``@triton.jit`` kernels is imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    from apex.testing import prepare_interpreter  # noqa: E402

    prepare_interpreter()

BACKENDS = ["torch", "triton"] if HAS_TRITON else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    """Run a test once on the PyTorch path and once on the Triton path (interpreted)."""
    import apex

    with apex.backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
