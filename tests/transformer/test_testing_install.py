"""apex.transformer.testing on a plain install: what its distributed test bases need, and the error without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "apex.transformer.testing.distributed_test_base"


def _import_without(missing: str) -> subprocess.CompletedProcess:
    """Import MODULE in a fresh interpreter in which ``missing`` cannot be imported (``None`` in
    ``sys.modules`` makes Python's import raise ModuleNotFoundError naming it, as when it is not installed)."""
    code = (f"import sys\nsys.modules[{missing!r}] = None\n"
            "import apex.transformer.testing  # the package itself needs nothing beyond torch\n"
            "try:\n"
            f"    import {MODULE}\n"
            "except ImportError as exc:\n"
            "    print(type(exc).__name__, exc.name, '|', exc)\n"
            "else:\n"
            "    print('imported')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("missing", ["expecttest", "numpy"])
def test_missing_test_dependency_names_the_extra(missing):
    proc = _import_without(missing)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert out.startswith(f"ModuleNotFoundError {missing} |"), out  # still an ImportError naming the module
    assert 'pip install "apex[testing]"' in out and MODULE in out, out


def test_the_testing_extra_declares_what_the_bases_import():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"expecttest", "numpy"} <= set(extras["testing"])
    assert {"expecttest", "numpy"} <= set(extras["test"])  # the test suite imports the bases below


def test_bases_import_with_the_extra_installed():
    pytest.importorskip("expecttest", reason="the test extra installs expecttest")
    from apex.transformer.testing import distributed_test_base as base

    assert issubclass(base.NcclDistributedTestBase, base.DistributedTestBase)
    assert base.HAS_TORCH_UCC_COMPAT_NVIDIA_DRIVER in (True, False)
