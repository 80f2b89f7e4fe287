"""train_gpt.py picks what is fast on the hardware, keeps its fp32 baseline in fp32, and leaves metrics behind
when interrupted. The hardware query is replaced both ways, so these tests mean the same on every CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apex import _hardware
from apex.amp import _amp_state
from apex.amp.frontend import _reset_casting

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "train_gpt.py"
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
        "--data-mb", "1", "--eval-batches", "2", "--threads", "1", "--sample-len", "0"]
NO_HALF = {"avx512_bf16": False, "amx_tile": False, "amx_fp16": False, "mkldnn_bf16": False, "mkldnn_fp16": False}
CPU = torch.device("cpu")


@pytest.fixture
def gpt():
    """train_gpt as a module of this process; amp and the thread count are put back afterwards."""
    sys.path.insert(0, str(GPT.parent))
    spec = importlib.util.spec_from_file_location("train_gpt_precision_test", GPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    _reset_casting()
    for name in ("opt_properties", "loss_scalers"):
        if hasattr(_amp_state, name):
            delattr(_amp_state, name)
    torch.set_num_threads(threads)
    sys.path.remove(str(GPT.parent))


@pytest.fixture(params=["no_bf16", "avx512_bf16"])
def hardware(request, monkeypatch):
    """The CPU without, then with, bf16 hardware, as PyTorch's queries would report it."""
    feats = {**NO_HALF, "avx512_bf16": request.param == "avx512_bf16"}
    monkeypatch.setattr(_hardware, "_cpu_features", lambda: feats)
    monkeypatch.setattr(_hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(_amp_state, "slow_half_warned", {("cpu", torch.bfloat16)}, raising=False)  # no timing
    _hardware.cache_clear()
    yield request.param == "avx512_bf16"
    _hardware.cache_clear()


def test_auto_precision_follows_the_hardware(gpt, hardware):
    args = gpt.parse_args([])
    dtype, opt_level, why = gpt.choose_precision(args, CPU)
    if hardware:
        assert (dtype, opt_level) == (torch.bfloat16, "O1") and "AVX512-BF16" in why
        assert gpt.default_steps(args, CPU) == gpt.STEPS_HALF
    else:
        assert (dtype, opt_level) == (torch.float32, "O0") and "no AVX512-BF16/AMX" in why
        assert gpt.default_steps(args, CPU) == gpt.STEPS_FP32
    assert gpt.attention_kind(args, dtype, CPU) == ("math" if hardware else "sdpa")
    # The plain PyTorch baseline is fp32 whatever the hardware.
    assert gpt.default_steps(gpt.parse_args(["--impl", "torch"]), CPU) == gpt.STEPS_FP32


def test_explicit_choices_are_obeyed(gpt, hardware):
    pick = lambda *argv: gpt.choose_precision(gpt.parse_args(list(argv)), CPU)[:2]  # noqa: E731
    assert pick("--dtype", "bf16") == (torch.bfloat16, "O1")
    assert pick("--dtype", "fp16", "--opt-level", "O2") == (torch.float16, "O2")
    assert pick("--opt-level", "O2") == (torch.bfloat16, "O2")  # a half level asked for by name
    assert pick("--opt-level", "O0") == (torch.float32, "O0")
    assert pick("--dtype", "fp32") == (torch.float32, "O0")
    for bad in (["--dtype", "fp32", "--opt-level", "O1"], ["--dtype", "bf16", "--opt-level", "O0"]):
        with pytest.raises(SystemExit):
            gpt.parse_args(bad)


def test_run_and_table_follow_the_hardware(gpt, hardware, tmp_path, capsys):
    out = tmp_path / "out"
    assert gpt.main([*TINY, "--steps", "3", "--eval-interval", "2", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())["runs"]["apex"]
    if hardware:
        assert (m["dtype"], m["opt_level"]) == ("bfloat16", "O1")
        assert "amp O1 bfloat16, FusedAdam, FusedLayerNorm" in printed
    else:
        assert (m["dtype"], m["opt_level"]) == ("float32", "O0")
        assert "amp O0 float32, FusedAdam, FusedLayerNorm" in printed and "no AVX512-BF16/AMX" in printed
    assert "precision chosen by" in printed and "--dtype auto" in m["why"]


class MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every matmul dispatched, forward and backward."""

    names = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward"}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.names:
            self.seen.append((func.__name__, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)
                                                   and a.is_floating_point())))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_compare_baseline_runs_every_matmul_in_fp32(gpt, attention):
    """With amp O1 bf16 switched on process-wide by the apex run, the baseline's forward and backward
    matmuls are still all fp32 (and the apex run's are bf16)."""
    args = gpt.parse_args([*TINY, "--compare", "--dtype", "bf16", "--steps", "4", "--attention", attention])
    info = gpt.DistInfo(device=CPU)
    apex_run, torch_run = gpt.Run(args, info, "apex"), gpt.Run(args, info, "torch")
    assert torch.is_autocast_enabled("cpu")  # amp O1 is on for the whole process
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    x, y = gpt.get_batch(data, 4, 16, seed=0)
    seen = {}
    for run in (apex_run, torch_run):
        rec = MatmulDtypes()
        with rec:
            run.train_step(0, x, y, timed=False)
        seen[run.impl] = rec.seen
    base = seen["torch"]
    backward = [n for n, _ in base if "backward" in n or n.startswith("mm")]
    assert len(base) >= 8 and backward, base  # forward and backward matmuls were both recorded
    assert all(set(ds) == {torch.float32} for _, ds in base), base
    assert any(torch.bfloat16 in ds for _, ds in seen["apex"]), seen["apex"]


def test_interrupted_run_leaves_metrics_and_plot(gpt, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_step = gpt.Run.train_step

    def step(self, i, *a, **kw):
        if i == 5:
            raise KeyboardInterrupt  # Ctrl-C in the middle of step 5
        return real_step(self, i, *a, **kw)

    monkeypatch.setattr(gpt.Run, "train_step", step)
    with pytest.raises(KeyboardInterrupt):
        gpt.main([*TINY, "--steps", "10", "--eval-interval", "2", "--no-progress", "--out", str(out)])
    m = json.loads((out / "metrics.json").read_text())
    assert m["finished"] is False and m["steps"] == 4
    h = m["runs"]["apex"]["history"]
    assert [s for s, _ in h["val"]] == [0, 2, 4] and len(h["train"]) == 4
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_progress_bar_ends_on_the_final_validation(gpt, tmp_path, capsys):
    # A whole run shorter than --eval-interval: the bar must not keep showing step 0's validation.
    assert gpt.main([*TINY, "--steps", "3", "--eval-interval", "50", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "(step 3)" in err.rsplit("\r", 1)[-1] or "(step 3)" in err.splitlines()[-1], err[-500:]


def test_ema_is_bias_corrected(gpt):
    from _common import ema

    assert ema([2.0] * 5) == pytest.approx([2.0] * 5)
    falling = [5.0 - 0.1 * i for i in range(20)]
    seeded, out = 5.0, []
    for v in falling:  # the old curve: seeded with the first value
        seeded = 0.9 * seeded + 0.1 * v
        out.append(seeded)
    corrected = ema(falling)
    assert corrected[0] == falling[0]
    # Bias correction lags less behind a falling loss: closer to the latest value at every step after the first.
    assert all(abs(c - v) < abs(s - v) for c, s, v in zip(corrected[1:], out[1:], falling[1:]))
