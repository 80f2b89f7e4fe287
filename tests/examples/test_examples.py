"""The example scripts, run for a few steps with tiny models so they cannot silently rot.

Each test starts the script the way a user does (a fresh ``python`` or ``torchrun`` process), with the
worktree on ``PYTHONPATH`` in place of an installed apex.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from apex import _hardware

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "train_gpt.py"
DIGITS = ROOT / "examples" / "train_digits.py"

# A model of a few thousand parameters on the first MiB of the corpus: a step takes milliseconds.
TINY_GPT = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
            "--data-mb", "1", "--eval-batches", "2", "--no-progress", "--threads", "1"]


def run(*cmd: str | Path, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def gpt(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return run(sys.executable, GPT, *TINY_GPT, *args, cwd=cwd)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def torchrun(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args)
    proc = run(*cmd, cwd=cwd)
    if proc.returncode != 0 and any(s in proc.stderr for s in ("terminate called", "SIGABRT", "SIGSEGV")):
        # Gloo on an overloaded machine has been seen to abort a rank while tearing down its connections,
        # after training finished. Say so and run once more; a second failure fails the test.
        warnings.warn(f"torchrun aborted during shutdown, retrying once:\n{proc.stderr[-2000:]}", stacklevel=2)
        proc = run(*cmd, cwd=cwd)
    return proc


def rank_checksums(stdout: str) -> dict[int, str]:
    # 16 hex digits exactly: torchrun merges the ranks' stdout, so another rank's text may follow on the line
    return {int(r): c for r, c in re.findall(r"rank (\d+): parameter checksum ([0-9a-f]{16})", stdout)}


# ----------------------------------------------------------------------------------------------------------
# train_gpt.py


def test_gpt_trains_reports_and_plots(tmp_path):
    out = tmp_path / "run"
    proc = ok(gpt("--steps", "12", "--eval-interval", "6", "--norm", "rms", "--sample-len", "16",
                  "--out", out, cwd=tmp_path))
    # The speed covers steps 2-12: a process does not time its first step (one-off warm-up costs).
    for label in ("steps", "tokens/s (steps 2-12)", "train time (s, steps 2-12)", "train loss (mean of last 6 steps)",
                  "final val loss", "val loss drop", "peak memory", "sample"):
        assert label in proc.stdout
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = metrics(out)["runs"]["apex"]
    # --dtype auto: bf16 where this CPU has bf16 hardware, fp32 (amp O0) where it does not.
    fast_bf16 = _hardware.has_fast_half("cpu", torch.bfloat16)
    assert (m["dtype"], m["opt_level"]) == (("bfloat16", "O1") if fast_bf16 else ("float32", "O0"))
    assert m["steps"] == 12 and m["finished"] and m["impl"] == "apex"
    assert [s for s, _ in m["history"]["val"]] == [0, 6, 12]
    assert len(m["history"]["train"]) == 12 and m["tokens_per_s"] > 0
    # 12 steps of a tiny model already move the loss off its starting point of about ln(256).
    assert m["final_val_loss"] < m["first_val_loss"] < 6.0


def test_gpt_compare_puts_both_runs_side_by_side(tmp_path):
    out = tmp_path / "cmp"
    proc = ok(gpt("--steps", "6", "--eval-interval", "3", "--sample-len", "0", "--compare", "--dtype", "bf16",
                  "--out", out, cwd=tmp_path))
    assert "apex / PyTorch" in proc.stdout and "speed ratio" in proc.stdout
    summary = metrics(out)
    a, t = summary["runs"]["apex"], summary["runs"]["torch"]
    assert (a["dtype"], t["dtype"]) == ("bfloat16", "float32")
    assert a["history"]["val"][0] == pytest.approx(t["history"]["val"][0], rel=0.01)  # same initial weights
    assert summary["speed_ratio"] == pytest.approx(a["tokens_per_s"] / t["tokens_per_s"])
    # Same seed, same data: after 6 steps the bf16 and fp32 runs are still close.
    assert abs(summary["val_loss_rel_diff"]) < 0.03
    assert (out / "compare.png").stat().st_size > 0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """An uninterrupted 10-step run that also saves a checkpoint at the end."""
    tmp = tmp_path_factory.mktemp("gpt_full")
    ok(gpt("--steps", "10", "--eval-interval", "4", "--sample-len", "0", "--save", tmp / "ckpt",
           "--out", tmp / "out", cwd=tmp))
    return tmp


def test_gpt_resume_equals_uninterrupted(tmp_path, uninterrupted):
    common = ["--steps", "10", "--eval-interval", "4", "--sample-len", "0", "--save-every", "3",
              "--out", tmp_path / "out"]
    ckpt = tmp_path / "ckpt"
    stopped = ok(gpt(*common, "--save", ckpt, "--stop-at", "5", cwd=tmp_path))
    assert "stopped at step 5 of 10" in stopped.stdout
    resumed = ok(gpt(*common, "--resume", ckpt, cwd=tmp_path))
    assert "resumed from" in resumed.stdout and "at step 5/10" in resumed.stdout
    # The table says which steps the speed covers: the resumed process ran steps 6-10 and timed 7-10.
    assert re.search(r"\| steps +\| +10 \(resumed at step 5\) \|", resumed.stdout), resumed.stdout
    assert "tokens/s (steps 7-10)" in resumed.stdout and "train time (s, steps 7-10)" in resumed.stdout
    assert metrics(tmp_path / "out")["first_step"] == 5
    full, part = metrics(uninterrupted / "out")["runs"]["apex"], metrics(tmp_path / "out")["runs"]["apex"]
    assert part["timed_steps"] == 4 and full["timed_steps"] == 9
    # Bit for bit: the loss curves of both runs and the final parameters are the same.
    assert part["history"] == full["history"]
    assert part["checksums"] == full["checksums"]


def load_script(path: Path):
    """An example script as a module, in this process (no interpreter start-up)."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpt_main():
    """train_gpt.main, called in this process (a refused checkpoint costs no interpreter start-up)."""
    threads = torch.get_num_threads()
    yield load_script(GPT).main
    torch.set_num_threads(threads)


@pytest.mark.parametrize("script", [GPT, DIGITS], ids=lambda p: p.stem)
def test_help_shows_each_default_once_and_every_option_has_help(script, capsys, monkeypatch):
    parsers = []
    parse = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", lambda self, *a, **k: (parsers.append(self),
                                                                                        parse(self, *a, **k))[1])
    with pytest.raises(SystemExit) as exit_:
        load_script(script).main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    (parser,) = parsers
    for action in parser._actions:
        name = "/".join(action.option_strings)
        assert action.help, f"{name} has no help"
        if isinstance(action, argparse._HelpAction):
            continue
        help_text = " ".join(action.help.split())
        if "default" in help_text or action.default is None or action.default is False:  # said, or nothing to say
            assert f"{help_text} (default:" not in text, name
        else:
            assert f"(default: {action.default})" in text, name
    if script == GPT:  # the defaults that depend on other options, explained once
        for explained in ("(default: 400 in a half type, 200 in fp32", "(default: O1 in a half type, O0 in fp32)",
                          "(default: --batch-size / 2M)"):
            assert text.count(explained) == 1 and f"{explained} (default:" not in text, explained


def test_gpt_progress_shows_speed_and_validation_only_once_measured():
    progress_text = load_script(GPT).progress_text

    class Run:
        history = {"val": [], "train": [(0, 5.5)]}
        rate = float("nan")  # the first step of a process is not timed

        def tokens_per_s(self):
            return self.rate

    run = Run()
    assert progress_text(run, 5.5) == "loss 5.500"
    run.history = {"val": [(0, 5.52)], "train": [(0, 5.5), (1, 5.4)]}
    run.rate = 12345.6
    assert progress_text(run, 5.4) == "loss 5.400 val 5.520 (step 0) 12,346 tok/s"


def test_gpt_resume_refuses_missing_and_corrupt_checkpoints(tmp_path, uninterrupted, gpt_main, capsys):
    args = [*TINY_GPT, "--steps", "10", "--eval-interval", "4", "--sample-len", "0",
            "--out", str(tmp_path / "out")]

    def refused(*extra: str | Path) -> str:
        assert gpt_main([*args, *map(str, extra)]) == 2
        return capsys.readouterr().err

    assert "no checkpoint found" in refused("--resume", tmp_path / "nowhere")
    good = (uninterrupted / "ckpt" / "checkpoint.pt").read_bytes()
    for name, data in {"truncated": good[: len(good) // 2], "garbage": b"not a checkpoint\n" * 10}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "checkpoint.pt").write_bytes(data)
        assert "corrupt or unreadable" in refused("--resume", tmp_path / name), name
    # A checkpoint of another model shape, or of the fp32 baseline, is refused too.
    assert "different settings" in refused("--n-embd", "64", "--resume", uninterrupted / "ckpt")
    assert "different settings" in refused("--impl", "torch", "--resume", uninterrupted / "ckpt")
    assert not (tmp_path / "out").exists()  # never a silent fresh start


def test_gpt_torchrun_two_ranks_end_identical(tmp_path):
    proc = ok(torchrun(GPT, *TINY_GPT, "--steps", "4", "--eval-interval", "2", "--sample-len", "0",
                       "--out", str(tmp_path / "out"), cwd=tmp_path))
    sums = rank_checksums(proc.stdout)
    assert sorted(sums) == [0, 1] and sums[0] == sums[1]
    assert "all 2 ranks have identical parameters" in proc.stdout
    m = metrics(tmp_path / "out")
    assert m["world_size"] == 2 and m["tokens_per_step"] == 2 * 4 * 16 and m["runs"]["apex"]["steps"] == 4


# ----------------------------------------------------------------------------------------------------------
# train_digits.py


def test_digits_learns_with_larc(tmp_path):
    proc = ok(run(sys.executable, DIGITS, "--epochs", "2", "--width", "16", "--larc", "--no-progress",
                  "--threads", "1", cwd=tmp_path))
    assert "FusedSGD + LARC" in proc.stdout
    acc = float(re.search(r"test accuracy: ([\d.]+)%", proc.stdout).group(1))
    assert acc > 80.0  # chance is 10%


def test_digits_torchrun_syncbn_two_ranks_end_identical(tmp_path):
    proc = ok(torchrun(DIGITS, "--epochs", "1", "--width", "8", "--no-progress", cwd=tmp_path))
    sums = rank_checksums(proc.stdout)
    assert sorted(sums) == [0, 1] and sums[0] == sums[1]
    assert "SyncBatchNorm + DDP" in proc.stdout and "test accuracy:" in proc.stdout
