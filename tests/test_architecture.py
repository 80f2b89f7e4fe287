"""Guards on the package's shape: one-way layering, a lean import, the public surface."""

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APEX = ROOT / "apex"

# Lower layers may never import higher ones. Index = layer; a module may import only its layer or lower.
LAYERS = [
    {"apex._backend", "apex._hardware", "apex._autocast_utils", "apex._kernels"},
    {"apex.ops"},
    {"apex.optimizers", "apex.normalization", "apex.multi_tensor_apply", "apex.fp16_utils", "apex.mlp",
     "apex.fused_dense", "apex.RNN"},
    {"apex.amp", "apex.parallel", "apex.transformer", "apex.distributed_testing"},
    {"apex.contrib"},
]


def _layer(module: str) -> int | None:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _modules():
    for path in sorted(APEX.rglob("*.py")):
        yield ".".join(path.relative_to(ROOT).with_suffix("").parts), path


@pytest.mark.parametrize("module,path", list(_modules()), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_imports_go_down_the_layers_only(module, path):
    own = _layer(module)
    if own is None:
        return
    for imp in _imports(path):
        if not imp.startswith("apex"):
            continue
        assert not imp.startswith("apex.testing"), f"{module} imports {imp}: apex.testing is for tests only"
        other = _layer(imp)
        if other is not None:
            assert other <= own, f"{module} (layer {own}) imports {imp} (layer {other})"


def test_kernels_import_only_triton_torch_and_kernels():
    for path in sorted((APEX / "_kernels").glob("*.py")):
        for imp in _imports(path):
            if imp.startswith("apex"):
                assert imp.startswith("apex._kernels"), f"{path.name} imports {imp}"
            src = path.read_text()
            assert "torch.autograd" not in src and "nn.Module" not in src, path.name


# apex._kernels._tuning holds launch configurations and the plan caches it empties together (no kernel, no
# triton): the ops' planned paths keep their tables there from import on, so that an override empties them too.
_KERNELS_AT_IMPORT = {"apex._kernels._tuning"}


def test_ops_import_their_kernels_lazily():
    for path in sorted((APEX / "ops").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.module == "apex._kernels":
                names = [f"apex._kernels.{a.name}" for a in node.names]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            else:
                continue
            for n in names:
                assert n in _KERNELS_AT_IMPORT or not n.startswith(("triton", "apex._kernels")), \
                    f"{path.name} imports {n} at module level: import kernels inside the Triton branch"


def test_importing_every_op_imports_no_triton():
    out = _run(
        "import sys, json, pkgutil, importlib, apex.ops\n"
        "for m in pkgutil.iter_modules(apex.ops.__path__):\n"
        "    importlib.import_module('apex.ops.' + m.name)\n"
        "loaded = [m for m in sys.modules if m == 'triton' or m.startswith(('triton.', 'apex._kernels.'))]\n"
        "print(json.dumps(sorted(loaded)))")
    assert json.loads(out) == sorted(_KERNELS_AT_IMPORT)


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout


def test_import_apex_is_lazy():
    out = _run(
        "import sys, json, apex, amp_C\n"
        "print(json.dumps({'triton': any(m == 'triton' or m.startswith('triton.') for m in sys.modules),"
        " 'sub': sorted(m for m in sys.modules if m.startswith('apex.'))}))")
    info = json.loads(out)
    assert not info["triton"], "import apex must not import triton"
    assert info["sub"] == ["apex._backend", "apex._compat"], info["sub"]


def test_import_apex_does_not_touch_cuda():
    out = _run("import torch, apex, amp_C\nprint(torch.cuda.is_initialized())")
    assert out.strip() == "False"


@pytest.mark.parametrize("version, refused", [("2.6.0+cu124", True), ("2.7.1", True),
                                              ("2.8.0a0+5228986c39.nv25.6", False), ("2.10.0", False),
                                              ("3.0.0", False)])
def test_import_apex_names_the_torch_floor(version, refused):
    """An older PyTorch is refused at import with the floor named (not a missing private function later);
    NVIDIA containers' pre-releases of a supported version import."""
    code = (f"import torch\ntorch.__version__ = torch.torch_version.TorchVersion({version!r})\n"
            "try:\n    import apex\nexcept ImportError as e:\n    print('refused', e)\nelse:\n    print('ok')")
    out = _run(code).strip()
    assert out.startswith("refused") == refused, out
    if refused:
        assert "torch>=2.8" in out and version in out


def test_import_apex_is_fast():
    code = ("import time, torch\nt = time.perf_counter()\nimport apex\n"
            "print(time.perf_counter() - t)")
    best = min(float(_run(code)) for _ in range(3))
    assert best < 0.5, f"import apex took {best:.3f} s on top of torch"


@pytest.mark.parametrize("name", ["amp", "optimizers", "normalization", "parallel", "fp16_utils",
                                  "multi_tensor_apply", "contrib"])
def test_subpackages_reachable_as_attributes(name):
    out = _run(f"import apex\nm = apex.{name}\nprint(m.__name__)")
    assert out.strip() == f"apex.{name}"


def test_dir_lists_the_public_names_only():
    import apex

    public = [n for n in dir(apex) if not n.startswith("_")]
    assert public == sorted(n for n in apex.__all__ if not n.startswith("_"))


def test_unknown_attribute_raises():
    import apex

    with pytest.raises(AttributeError):
        apex.not_a_module  # noqa: B018


def _compat_modules() -> list[str]:
    from apex._compat import MODULES

    return list(MODULES)


def test_compat_modules_live_in_one_home_and_are_installed():
    import tomllib

    from apex._compat import MODULES

    home = APEX / "_compat"
    files = sorted(p.stem for p in home.glob("*.py") if p.stem != "__init__")
    assert files == sorted(MODULES)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(config["py-modules"]) == sorted(MODULES)
    assert config["package-dir"][""] == "apex/_compat"
    assert not [p.name for p in ROOT.glob("*.py")], "compatibility modules belong in apex/_compat"


@pytest.mark.parametrize("name", _compat_modules())
def test_compat_module_names_resolve(name):
    module = importlib.import_module(name)
    assert Path(module.__file__).parent == APEX / "_compat"
    missing = []
    for attr in module.__all__:
        try:
            getattr(module, attr)
        except (AttributeError, ImportError):
            missing.append(attr)
    assert not missing, f"{name} names without an implementation: {missing}"
    with pytest.raises(AttributeError):
        module.not_a_name  # noqa: B018


def test_no_module_is_too_long():
    long = [str(p.relative_to(ROOT)) for p in APEX.rglob("*.py") if len(p.read_text().splitlines()) > 600]
    assert not long, f"split these modules: {long}"


def test_public_names_importable_from_apex_locations():
    importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier  # noqa: B018


def test_the_package_does_not_import_the_repository_folders():
    """An installed apex has no benchmarks/, tests/ or examples/: what it needs from them is passed in."""
    for module, path in _modules():
        for imp in _imports(path):
            assert imp.split(".")[0] not in ("benchmarks", "tests", "examples"), f"{module} imports {imp}"


def test_ops_keep_no_set_constants():
    """The ops' argument checks run under torch.compile; Dynamo before torch 2.11 (the floor is 2.8) cannot
    trace a membership test in a module-level frozenset or set, so their constant sets are dict keys
    (``apex.ops._checks.member_set``: as fast a lookup)."""
    found = []
    for path in sorted((APEX / "ops").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                v = node.value
                # (an empty set() is a cache, read only outside tracing)
                if isinstance(v, (ast.Set, ast.SetComp)) or (isinstance(v, ast.Call) and isinstance(v.func, ast.Name)
                                                              and v.func.id in ("frozenset", "set") and v.args):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"module-level sets in apex/ops (use member_set): {found}"


# Modules of apex._kernels without a kernel (nor Triton) that the CPU path may use: launch configurations and the
# plan caches (_tuning), the multi-tensor ops' lists of tensors (_lists).
_KERNELS_WITHOUT_TRITON = {"apex._kernels._tuning", "apex._kernels._lists"}


def test_cpu_calls_of_every_fused_op_need_no_triton():
    """Triton is an optional extra: every fused op, optimizer and multi-tensor op works on CPU tensors with the
    default backend where it cannot be imported, and such calls load no kernel module (a planned eager path
    asks the backend before it plans: a plan may load its kernels)."""
    env = {k: v for k, v in os.environ.items() if k not in ("APEX_BACKEND", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_cpu_without_triton.py")], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["failed"] == {}, info["failed"]
    assert set(info["loaded"]) <= _KERNELS_WITHOUT_TRITON, info["loaded"]
