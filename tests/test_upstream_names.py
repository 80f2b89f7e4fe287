"""Every name NVIDIA Apex's package ``__init__.py`` files bind is reachable from the same package here, or
listed in ``OMISSIONS`` with its reason (documented in docs/migrating.md, "Names Apex's packages export").

The expected names come from ``tests/upstream_names.json``, generated from Apex's source text by
``tests/gen_upstream_names.py`` (its docstring says how and what counts as a name). With
``APEX_UPSTREAM_GIT`` pointing at a git copy of NVIDIA/apex, ``test_table_is_current`` also regenerates the
table and compares.
"""

from __future__ import annotations

import importlib
import json
import os

import pytest

from tests import gen_upstream_names

with open(gen_upstream_names.OUT) as _f:
    TABLE = json.load(_f)

_LOGGING = ("part of Apex's import-time logging setup (a StreamHandler with this formatter attached to the "
            "`apex` logger); importing apex here configures no logging")

# package -> {name: reason}; "*" for a whole package that is not provided.
OMISSIONS: dict[str, dict[str, str]] = {
    "apex": {
        "RankInfoFormatter": _LOGGING,
        "handler": _LOGGING,
    },
    "apex.contrib.openfold_triton": {
        name: "Apex's @triton.jit LayerNorm kernels, whose launch signatures belong to Apex's launchers; the "
              "LayerNorm here runs its own kernels (apex._kernels) behind LayerNormSmallShapeOptImpl, and "
              "importing the package imports no Triton"
        for name in ("_layer_norm_backward_dw_db_partial", "_layer_norm_backward_dw_db_partial_strided",
                     "_layer_norm_backward_dx", "_layer_norm_backward_dx_strided", "_layer_norm_forward",
                     "_layer_norm_forward_strided")
    },
    "apex.contrib.torchsched.inductor": {
        "*": "Apex's multi-stream CUDA scheduling for Inductor (patch_graph_lowering) is not ported; the "
             "torchsched backend uses Inductor's default scheduling",
    },
}


def _missing(package: str, names: list[str]) -> list[str] | None:
    """The names ``package`` lacks here; None when the package itself cannot be imported."""
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as e:
        if e.name is not None and package.startswith(e.name):
            return None
        raise
    return [n for n in names if not hasattr(module, n)]


@pytest.mark.parametrize("package", list(TABLE["packages"]))
def test_upstream_names_reachable(package):
    names = TABLE["packages"][package]["names"]
    omitted = OMISSIONS.get(package, {})
    missing = _missing(package, names)
    if missing is None:
        assert "*" in omitted, f"package {package} is missing (and not listed in OMISSIONS)"
        return
    assert "*" not in omitted, f"{package} is listed as not provided, but it imports: drop it from OMISSIONS"
    unexpected = sorted(set(missing) - set(omitted))
    assert not unexpected, f"{package} lacks Apex's {unexpected}"
    stale = sorted(set(omitted) - set(missing))
    assert not stale, f"{package} provides {stale} now: drop them from OMISSIONS"


def test_omissions_name_upstream_names():
    for package, names in OMISSIONS.items():
        assert package in TABLE["packages"], f"{package} is not an Apex package in the table"
        known = set(TABLE["packages"][package]["names"]) | {"*"}
        assert set(names) <= known, f"{package}: {sorted(set(names) - known)} are not Apex names"
        assert all(reason.strip() for reason in names.values())


def test_interleaved_schedule_selected_by_identity(monkeypatch):
    """Code that picks a schedule compares ``get_forward_backward_func``'s result with the package's names."""
    from apex.transformer import parallel_state
    from apex.transformer.pipeline_parallel import schedules
    from apex.transformer.pipeline_parallel.schedules import fwd_bwd_pipelining_with_interleaving as interleaved

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(schedules, "get_num_microbatches", lambda: 4)
    assert schedules._forward_backward_pipelining_with_interleaving is \
        interleaved._forward_backward_pipelining_with_interleaving
    assert schedules.get_forward_backward_func(2, 2) is schedules._forward_backward_pipelining_with_interleaving
    assert schedules.get_forward_backward_func(None, 2) is schedules.forward_backward_pipelining_without_interleaving
    assert issubclass(schedules.ExperimentalWarning, Warning)


@pytest.mark.skipif(not os.environ.get("APEX_UPSTREAM_GIT"), reason="APEX_UPSTREAM_GIT (a git copy of NVIDIA/apex) "
                    "is not set")
def test_table_is_current():
    repo = os.environ["APEX_UPSTREAM_GIT"]
    if not os.path.isfile(os.path.join(repo, "HEAD")):
        repo = os.path.join(repo, ".git")
    fresh = gen_upstream_names.generate(repo, tuple(TABLE["revisions"].values()))  # the recorded commits
    names = {p: e["names"] for p, e in fresh["packages"].items()}
    assert names == {p: e["names"] for p, e in TABLE["packages"].items()}, "tests/upstream_names.json is stale"


def test_top_level_deprecation_and_cudnn_helpers_behave_as_apex():
    import warnings

    import torch

    import apex

    assert issubclass(apex.DeprecatedFeatureWarning, FutureWarning)
    with pytest.warns(apex.DeprecatedFeatureWarning, match="going away"):
        apex.deprecated_warning("going away")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="`bottleneck` depends on cuDNN 99999999"):
            apex.check_cudnn_version_and_warn("bottleneck", 99999999)
    with warnings.catch_warnings(record=True):
        assert apex.check_cudnn_version_and_warn("bottleneck", 0) is bool(torch.backends.cudnn.is_available())
