"""One spawn per world size for all of apex.transformer's distributed checks.

Spawning Gloo ranks costs seconds each time, so every ``check_*`` function of the modules in
``MODULES`` runs inside a single spawn per world size; each rank records per-check outcomes in a JSON
file and the tests assert on the merged outcome. A check that breaks the collective order makes the
following ones fail with the process group's (short) timeout instead of hanging.

After each check the ranks count where it failed. A check that failed on every rank (typically the same
assertion everywhere) leaves them in step, each having run it and then ``destroy_model_parallel``: the next
checks run. One that failed on some ranks only may have left the others inside a collective, so the
remaining checks are not run and say why.

On a GPU (``APEX_TEST_DEVICE=cuda``: the ``dist_device`` fixture) one more spawn per world size runs the
checks of ``DEVICE_MODULES`` with every rank on that GPU, through Gloo.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import tempfile
import traceback

from apex.testing import run_distributed

MODULES = (
    "tests.transformer.test_parallel_state",
    "tests.transformer.test_mappings",
    "tests.transformer.test_layers",
    "tests.transformer.test_cross_entropy",
    "tests.transformer.test_random",
    "tests.transformer.test_utils",
    "tests.transformer.test_gpt_tp",
)


# The modules whose checks also run with the ranks on a GPU; the tensor-parallel layers first, since a
# check failing on some ranks only stops the ones after it.
DEVICE_MODULES = (
    "tests.transformer.test_layers",
    "tests.transformer.test_mappings",
    "tests.transformer.test_cross_entropy",
)


def checks_of(module) -> list[str]:
    return sorted(n for n in vars(module) if n.startswith("check_") and callable(getattr(module, n)))


def _all_checks(rank: int, world_size: int, out_dir: str, modules: tuple[str, ...] = MODULES) -> None:
    import torch

    from apex.transformer import parallel_state
    from apex.transformer.tensor_parallel import get_cuda_rng_tracker

    if os.environ.get("APEX_DIST_TRACE"):
        import faulthandler
        faulthandler.dump_traceback_later(60, exit=True)
    results = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        for check in checks_of(module):
            key = f"{name}:{check}"
            if os.environ.get("APEX_DIST_TRACE"):
                print(f"[rank {rank}] {key}", flush=True)
            torch.manual_seed(1234 + rank)
            try:
                getattr(module, check)(rank, world_size)
                results[key] = None
            except (Exception, AssertionError, BaseException) as e:  # noqa: B014 - pytest.fail is a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                results[key] = traceback.format_exc()
                if os.environ.get("APEX_DIST_TRACE"):
                    print(f"[rank {rank}] FAILED {key}\n{results[key]}", flush=True)
            finally:
                parallel_state.destroy_model_parallel()
                get_cuda_rng_tracker().reset()
            # A check that failed on some ranks only may have left them out of step (group creation is
            # collective): stop here rather than hang, and say why the rest did not run. Failed on every
            # rank, it normally failed at the same point on each: go on (were the ranks out of step after
            # all, the group's timeout would fail the next checks instead of hanging).
            failed = torch.tensor([float(results[key] is not None)])
            torch.distributed.all_reduce(failed)
            if 0 < failed.item() < world_size:
                stopped = f"not run: {key} failed on {int(failed.item())} of {world_size} ranks"
                break
        else:
            continue
        break
    else:
        stopped = None
    if stopped is not None:
        for name in modules:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError:
                continue
            for check in checks_of(module):
                results.setdefault(f"{name}:{check}", stopped)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@functools.cache
def results(world_size: int, device: str = "cpu") -> dict:
    return run_checks(world_size, MODULES if device == "cpu" else DEVICE_MODULES, device)


def run_checks(world_size: int, modules: tuple[str, ...], device: str = "cpu") -> dict:
    """Every check of ``modules`` on ``world_size`` ranks in one spawn: ``{"module:check": None}`` for a
    check that passed on every rank, else the failing ranks' tracebacks (or why it did not run)."""
    with tempfile.TemporaryDirectory() as d:
        # On a GPU a rank may wait on another that compiles Triton kernels: a longer timeout there.
        run_distributed(_all_checks, world_size, d, modules, timeout_s=30.0 if device == "cpu" else 120.0,
                        device=device)
        merged: dict = {}
        for rank in range(world_size):
            with open(os.path.join(d, f"rank{rank}.json")) as f:
                for key, err in json.load(f).items():
                    if err is not None:
                        merged[key] = (merged.get(key) or "") + f"--- rank {rank}\n{err}"
                    else:
                        merged.setdefault(key, None)
    return merged


def assert_check(module_name: str, check: str, world_size: int, device=None) -> None:
    """Fail with the ranks' tracebacks if ``check`` of ``module_name`` failed on any rank. ``device``: the
    ``dist_device`` fixture's value (the CPU by default)."""
    device = str(device or "cpu")
    if device != "cpu" and module_name not in DEVICE_MODULES:
        raise ValueError(f"{module_name} is not in DEVICE_MODULES: its checks run on the CPU only")
    res = results(world_size, device)
    key = f"{module_name}:{check}"
    assert key in res, f"{key} did not run"
    if res[key] is not None:
        raise AssertionError(res[key])
