"""train_gpt.py with --tensor-parallel / --pipeline-parallel: tensor × pipeline × data-parallel training on Gloo
ranks started by torchrun ends where the one-process run of the same seed and global batch ends.

The one-process reference runs in this process (no interpreter start-up); each parallel layout is a real
``torchrun`` launch, as a user starts it. All runs compute in fp32, so the layouts differ from the reference
only by the order of fp32 sums (split matmuls, all-reduces): every step's loss agrees to 1e-4 after 20 steps.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from apex.amp import _amp_state
from apex.amp.frontend import _reset_casting
from tests.examples.test_examples import GPT, ok, run

STEPS = 20
# Two blocks (one per stage with PP=2), two heads (one per tensor rank with TP=2), fp32.
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--data-mb", "1",
        "--eval-batches", "1", "--eval-interval", "10", "--no-progress", "--threads", "1", "--dtype", "fp32",
        "--sample-len", "0", "--steps", str(STEPS), "--dist-timeout", "60"]
GLOBAL_BATCH = 8


def load_gpt():
    sys.path.insert(0, str(GPT.parent))
    spec = importlib.util.spec_from_file_location("train_gpt_3d_test", GPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The one-process run: batch of GLOBAL_BATCH rows, the same seed."""
    out = tmp_path_factory.mktemp("gpt_ref")
    threads = torch.get_num_threads()
    try:
        assert load_gpt().main([*TINY, "--batch-size", str(GLOBAL_BATCH), "--out", str(out)]) == 0
    finally:  # amp and the thread count as they were
        _reset_casting()
        for name in ("opt_properties", "loss_scalers"):
            if hasattr(_amp_state, name):
                delattr(_amp_state, name)
        torch.set_num_threads(threads)
        sys.path.remove(str(GPT.parent))
    return json.loads((out / "metrics.json").read_text())["runs"]["apex"]


def torchrun(nproc: int, *args: str, cwd: Path):
    cmd = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), GPT,
           *TINY, *args)
    return ok(run(*cmd, cwd=cwd, timeout=300))


# (ranks, tensor, pipeline, per-replica batch): data parallel = ranks / (tensor x pipeline). TP=2 alone and
# PP=2 alone are covered against one process in tests/transformer; here the example's own wiring.
LAYOUTS = {
    "tp2_pp2": (4, 2, 2, GLOBAL_BATCH),
    "pp2_dp2": (4, 1, 2, GLOBAL_BATCH // 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_run_matches_one_process(layout, reference, tmp_path):
    nproc, tp, pp, batch = LAYOUTS[layout]
    out = tmp_path / "out"
    proc = torchrun(nproc, "--tensor-parallel", str(tp), "--pipeline-parallel", str(pp), "--batch-size", str(batch),
                    "--out", str(out), cwd=tmp_path)
    dp = nproc // (tp * pp)
    assert f"tensor {tp} x pipeline {pp} x data {dp}" in proc.stdout
    assert "the data-parallel replicas of every shard have identical parameters" in proc.stdout
    m = json.loads((out / "metrics.json").read_text())
    got = m["runs"]["apex"]
    lay = got["parallel"]
    assert (lay["tensor"], lay["pipeline"], lay["data"]) == (tp, pp, dp)
    # The default micro-batch gives 2 x PP microbatches; PP = 1 runs the global batch in one.
    assert lay["microbatches"] * lay["micro_batch_size"] == batch and lay["microbatches"] == (2 * pp if pp > 1 else 1)
    assert lay["schedule"] == ("forward_backward_pipelining_without_interleaving" if pp > 1
                               else "forward_backward_no_pipelining")
    assert m["tokens_per_step"] == GLOBAL_BATCH * 16
    assert got["params"] == reference["params"]
    ref_train, got_train = reference["history"]["train"], got["history"]["train"]
    assert [s for s, _ in got_train] == list(range(STEPS))
    # The loss moved (the run trained) and every step's loss, the last included, matches the reference.
    assert ref_train[-1][1] < ref_train[0][1] - 0.02
    assert max(abs(a - b) for (_, a), (_, b) in zip(ref_train, got_train)) < 1e-4
    assert [s for s, _ in got["history"]["val"]] == [0, 10, 20]
    assert got["final_val_loss"] == pytest.approx(reference["final_val_loss"], abs=1e-4)


def test_layouts_that_do_not_fit_are_refused(tmp_path, capsys):
    gpt = load_gpt()
    try:
        # One process cannot hold two tensor ranks: refused before any work, naming the sizes.
        assert gpt.main([*TINY, "--tensor-parallel", "2", "--out", str(tmp_path / "a")]) == 2
        assert "world size (1 ranks) is not divisible by --tensor-parallel (2)" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            gpt.parse_args([*TINY, "--pipeline-parallel", "2", "--compare"])
        for bad in (["--tensor-parallel", "0"], ["--tensor-parallel", "2", "--opt-level", "O2"]):
            with pytest.raises(SystemExit):
                gpt.parse_args([*TINY, *bad])
        assert not (tmp_path / "a").exists()
    finally:
        sys.path.remove(str(GPT.parent))
    from _gpt_parallel import check_layout  # noqa: E402  (examples/ is on sys.path after load_gpt)

    with pytest.raises(ValueError, match=r"--n-head \(2\)"):
        check_layout(4, 4, 1, 2, 2)
    with pytest.raises(ValueError, match=r"--n-layer \(2\) must be at least --pipeline-parallel \(4\)"):
        check_layout(4, 1, 4, 2, 2)
    assert check_layout(8, 2, 2, 2, 2) == 2
