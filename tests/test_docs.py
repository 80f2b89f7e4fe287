"""The documentation covers the public API.

(a) every public name of every public module and compatibility module has a docstring;
(b) every public name is in the built site's ``objects.inv`` (when ``docs/_build/html`` exists, or built
    here into a temporary folder when ``APEX_DOCS_BUILD=1`` and Sphinx is installed);
(c) the walker of (a) does fail on a module with a docstring-less public function.

The walk lives in ``docs/_apidoc.py``, which also generates the reference pages, so the pages and this
test cannot disagree about what is public. The normal suite needs neither Sphinx nor a build.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import _apidoc  # noqa: E402

sys.path.remove(str(DOCS))

# Packages that other changes are writing right now: their names are checked by the xfail test below
# until those changes land (then drop the prefix from this tuple). A name counts as theirs when its
# exporting module or the module that defines it starts with one of these.
IN_PROGRESS: tuple[str, ...] = ()  # package prefixes whose docstrings are still being written


def _in_progress(full_name: str, obj: object) -> bool:
    homes = (full_name, getattr(obj, "__module__", None) or "")
    return any(h == p or h.startswith(p + ".") for h in homes for p in IN_PROGRESS)


@pytest.fixture(scope="module")
def walk() -> _apidoc.Walk:
    return _apidoc.walk()


def test_walk_finds_the_public_api(walk):
    names = {m.__name__ for m in walk.modules}
    for expected in ("apex", "apex.amp", "apex.optimizers", "apex.normalization", "apex.parallel",
                     "apex.transformer.parallel_state", "apex.contrib.xentropy"):
        assert expected in names
    assert not any(n.startswith(("apex.ops", "apex.testing")) for n in names)
    assert {m.__name__ for m in walk.compat} >= {"amp_C", "fused_layer_norm_cuda"}
    # Modules that do not import yet are reported by name (another change may be writing them).
    for name, error in walk.failed.items():
        print(f"not importable: {name}: {error}")


def test_every_public_name_has_a_docstring(walk):
    missing = [n for n, obj in _apidoc.undocumented(walk.modules + walk.compat) if not _in_progress(n, obj)]
    assert missing == [], "public names without a docstring"


def _fixture_module(with_docstring: bool) -> types.ModuleType:
    module = types.ModuleType("apex_docs_fixture", "A fixture module.")

    def documented(x: int) -> int:
        """Return ``x``."""
        return x

    def undocumented(x: int) -> int:
        return x

    if with_docstring:
        undocumented.__doc__ = "Now documented."
    module.documented = documented
    module.undocumented = undocumented
    module.CONSTANT = 3  # data needs no docstring of its own
    module.__all__ = ["documented", "undocumented", "CONSTANT"]
    return module


def test_walker_fails_on_a_public_function_without_docstring():
    assert _apidoc.missing_docstrings([_fixture_module(with_docstring=False)]) == ["apex_docs_fixture.undocumented"]
    assert _apidoc.missing_docstrings([_fixture_module(with_docstring=True)]) == []
    nameless = types.ModuleType("apex_docs_fixture_nodoc")
    nameless.__all__ = []
    assert _apidoc.missing_docstrings([nameless]) == ["apex_docs_fixture_nodoc"]


def test_walker_without_all_takes_the_functions_defined_here():
    module = types.ModuleType("apex_docs_fixture2", "Doc.")
    exec("def f():\n    pass\n\ndef _private():\n    pass\n", module.__dict__)  # noqa: S102
    module.imported = os.path.join  # defined elsewhere: not part of this module's API
    assert _apidoc.public_names(module) == ["f"]
    assert _apidoc.missing_docstrings([module]) == ["apex_docs_fixture2.f"]


def test_every_contrib_package_has_a_section():
    text = (DOCS / "contrib.md").read_text()
    packages = sorted(p.name for p in (ROOT / "apex" / "contrib").iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
    assert [p for p in packages if f"## `{p}`" not in text] == []


def _inventory() -> Path | None:
    built = DOCS / "_build" / "html" / "objects.inv"
    if os.environ.get("APEX_DOCS_BUILD") == "1":
        if importlib.util.find_spec("sphinx") is None:
            pytest.skip("APEX_DOCS_BUILD=1 needs Sphinx: pip install -e '.[docs]'")
        out = Path(tempfile.mkdtemp(prefix="apex-docs-"))
        subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html", str(DOCS), str(out)], check=True)
        return out / "objects.inv"
    return built if built.exists() else None


def test_every_public_name_is_in_the_inventory(walk):
    path = _inventory()
    if path is None:
        pytest.skip("no built site: build it (README) or set APEX_DOCS_BUILD=1")
    # (a site built in another environment: reading its inventory takes Sphinx here too)
    InventoryFile = pytest.importorskip("sphinx.util.inventory").InventoryFile  # noqa: N806

    with open(path, "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    python_names = {name for kind, entries in inventory.items() if kind.startswith("py:") for name in entries}
    homes = _apidoc._home_modules(walk)
    missing = []
    for module in walk.modules + walk.compat:
        if module.__name__ not in python_names and not _shadowed(module.__name__):
            missing.append(module.__name__)
        for name in _apidoc.public_names(module):
            obj = getattr(module, name)
            if _apidoc.kind(obj) == "module" and _apidoc.is_internal(obj.__name__):
                continue  # apex.testing: test support, described in the contributing guide
            full = obj.__name__ if _apidoc.kind(obj) == "module" else f"{module.__name__}.{name}"
            if full not in python_names:
                missing.append(full)
            if (_apidoc.kind(obj) == "class" and obj.__name__ == name
                    and homes.get(id(obj), module.__name__) == module.__name__):
                # Documented public methods a class takes from apex's internal mixins are its API too (where the
                # class is documented under its own name: another name renders as an alias, without members).
                for base in _apidoc.private_bases(obj):
                    missing += [f"{full}.{m}" for m, v in vars(base).items()
                                if not m.startswith("_") and callable(v) and getattr(v, "__doc__", None)
                                and f"{full}.{m}" not in python_names]
    assert missing == [], f"missing from the built site (rebuild it, see the README): {missing}"


def _shadowed(module_name: str) -> bool:
    """A module whose name is also a function's (``apex.normalization.fused_layer_norm``): the function wins."""
    parent, _, base = module_name.rpartition(".")
    return bool(parent) and _apidoc.kind(getattr(sys.modules.get(parent), base, None)) not in ("module", "data")
