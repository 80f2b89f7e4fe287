"""examples/amp/main_amp.py trains, and its --save/--resume (Apex's checkpoint recipe) resumes bit for bit."""

import runpy
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "amp" / "main_amp.py"
pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def main():
    return runpy.run_path(str(SCRIPT))["main"]


@pytest.mark.parametrize("opt_level,half", [("O1", "bf16"), ("O2", "fp16")])
def test_example_resumes_bit_for_bit(main, tmp_path, opt_level, half):
    common = ["--opt-level", opt_level, "--half", half, "--verbosity", "0"]
    full = main(common + ["--epochs", "3"])
    ckpt = str(tmp_path / "ckpt.pt")
    main(common + ["--epochs", "2", "--save", ckpt])
    resumed = main(common + ["--epochs", "3", "--resume", ckpt])
    assert full["test_acc"] > 0.9
    a, b = full["model"].state_dict(), resumed["model"].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert full["test_loss"] == resumed["test_loss"]
