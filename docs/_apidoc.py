"""The public API of apex, walked from the code, and the reference pages generated from it.

``docs/conf.py`` writes ``docs/api/*.rst`` from :func:`write_api_pages` at every build, and
``tests/test_docs.py`` checks the same walk (a docstring for every public name, and every public name in
the built site's ``objects.inv``), so the reference cannot drift from the code.

Public modules are the modules under ``apex`` whose dotted path has no ``_``-prefixed part, less the
internal layers (``apex.ops``, ``apex.testing``, ``apex.__main__``), plus the compatibility modules listed
in ``apex._compat.MODULES``. A module's public names are its ``__all__``; a module without ``__all__``
exports the classes and functions it defines whose names do not start with ``_``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

# Internal layers: documented in the contributing guide, not part of the API reference.
INTERNAL = ("apex.ops", "apex.testing", "apex.__main__")

# One reference page per area; a module belongs to the longest matching prefix.
AREAS = {
    "apex": "apex (top level)",
    "apex.amp": "apex.amp",
    "apex.fp16_utils": "apex.fp16_utils",
    "apex.optimizers": "apex.optimizers",
    "apex.multi_tensor_apply": "apex.multi_tensor_apply",
    "apex.normalization": "apex.normalization",
    "apex.parallel": "apex.parallel",
    "apex.transformer": "apex.transformer",
    "apex.mlp": "apex.mlp",
    "apex.fused_dense": "apex.fused_dense",
    "apex.RNN": "apex.RNN",
    "apex.contrib": "apex.contrib",
}


@dataclass
class Walk:
    """The result of walking the API: importable modules in order, and the ones that failed to import."""

    modules: list[types.ModuleType] = field(default_factory=list)
    compat: list[types.ModuleType] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def is_internal(name: str) -> bool:
    """True for the internal layers and any path with a ``_``-prefixed part."""
    return any(name == p or name.startswith(p + ".") for p in INTERNAL) or any(
        part.startswith("_") for part in name.split(".")
    )


def walk(root: str = "apex") -> Walk:
    """Import every public module under ``root`` (packages before their submodules) and every compat module."""
    result = Walk()

    def visit(name: str) -> None:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a module another change has not finished yet: report, do not crash
            result.failed[name] = f"{type(exc).__name__}: {exc}"
            return
        result.modules.append(module)
        if hasattr(module, "__path__"):
            for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda i: i.name):
                child = f"{name}.{info.name}"
                if not is_internal(child):
                    visit(child)

    visit(root)
    compat = importlib.import_module("apex._compat")
    for name in compat.MODULES:
        try:
            result.compat.append(importlib.import_module(name))
        except Exception as exc:
            result.failed[name] = f"{type(exc).__name__}: {exc}"
    return result


def public_names(module: types.ModuleType) -> list[str]:
    """The module's ``__all__``, or the classes and functions it defines without a leading ``_``."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return sorted(
        n
        for n, obj in vars(module).items()
        if not n.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == module.__name__
    )


def kind(obj: object) -> str:
    """How a public object is documented: ``module``, ``class``, ``function`` or ``data``."""
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return "data"


def needs_docstring(obj: object) -> bool:
    """Modules, classes and callables carry their own docstring; data (constants, tables) is described by its module."""
    return kind(obj) != "data"


def has_docstring(obj: object) -> bool:
    """Whether ``obj`` has a non-empty docstring of its own (a class may inherit one from an apex base)."""
    owner = _function_class(obj)
    if owner is not None:  # ``f = SomeFunction.apply``: documented by its autograd Function
        obj = owner
    doc = inspect.getdoc(obj)
    return bool(doc and doc.strip())


def _function_class(obj: object) -> type | None:
    """The autograd Function whose ``apply`` ``obj`` is (Apex exports several such aliases), else None."""
    owner = getattr(obj, "__self__", None)
    if inspect.ismethod(obj) and obj.__name__ == "apply" and inspect.isclass(owner):
        return owner
    return None


def undocumented(modules: list[types.ModuleType]) -> list[tuple[str, object]]:
    """``(module.name, object)`` for every public name (and module) that needs a docstring and has none."""
    missing: list[tuple[str, object]] = []
    for module in modules:
        if not has_docstring(module):
            missing.append((module.__name__, module))
        for name in public_names(module):
            try:
                obj = getattr(module, name)
            except Exception as exc:
                missing.append((f"{module.__name__}.{name} (cannot be resolved: {type(exc).__name__})", None))
                continue
            if needs_docstring(obj) and not has_docstring(obj):
                missing.append((f"{module.__name__}.{name}", obj))
    return missing


def missing_docstrings(modules: list[types.ModuleType]) -> list[str]:
    """``module.name`` for every public name (and module) that needs a docstring and has none."""
    return [name for name, _ in undocumented(modules)]


def _home_modules(w: Walk) -> dict[int, str]:
    """For each public object, the module that documents it in full; other modules that export it link there.

    The home is the shortest public module that exports the object and is a prefix of the object's own
    ``__module__`` (``apex.optimizers`` for ``apex.optimizers.fused_adam.FusedAdam``), else the first
    exporter in walk order.
    """
    exporters: dict[int, list[str]] = {}
    for module in w.modules:
        for name in public_names(module):
            obj = getattr(module, name, None)
            if obj is None or kind(obj) in ("module", "data"):
                continue
            exporters.setdefault(id(obj), []).append(module.__name__)
    homes = {}
    for module in w.modules:
        for name in public_names(module):
            obj = getattr(module, name, None)
            if obj is None or id(obj) in homes or kind(obj) in ("module", "data"):
                continue
            own = getattr(obj, "__module__", "") or ""
            prefixed = [m for m in exporters[id(obj)] if own == m or own.startswith(m + ".")]
            homes[id(obj)] = min(prefixed, key=len) if prefixed else exporters[id(obj)][0]
    return homes


def _area(module_name: str) -> str:
    best = "apex"
    for prefix in AREAS:
        if module_name == prefix or module_name.startswith(prefix + "."):
            best = max(best, prefix, key=len)
    return best


def _attr_docs(module: types.ModuleType) -> set[str]:
    """Module-level names documented with a ``#:`` comment or a string after the assignment."""
    from sphinx.pycode import ModuleAnalyzer

    try:
        return {name for (scope, name) in ModuleAnalyzer.for_module(module.__name__).find_attr_docs() if not scope}
    except Exception:
        return set()


def _underline(text: str, char: str) -> str:
    return f"{text}\n{char * len(text)}\n"


def _module_section(module: types.ModuleType, homes: dict[int, str], char: str, names: dict[int, str]) -> list[str]:
    # py:module + the docstring rather than automodule: ``apex.parallel.LARC`` (a module) is shadowed by the
    # class of the same name in ``apex.parallel``, which autodoc's attribute lookup would find instead.
    parent, _, base = module.__name__.rpartition(".")
    # ``apex.normalization.fused_layer_norm`` is both a module and a function of ``apex.normalization``
    # (upstream's layout); the function keeps the name in the index.
    shadowed = parent and kind(getattr(sys.modules.get(parent), base, None)) not in ("module", "data")
    lines = [_underline(f"``{module.__name__}``", char), f".. py:module:: {module.__name__}",
             *(["   :no-index:"] if shadowed else []), "",
             inspect.getdoc(module) or "", ""]
    submodules = [getattr(module, n) for n in public_names(module) if kind(getattr(module, n, None)) == "module"]
    if submodules:
        lines += ["Submodules: " + ", ".join(f":py:mod:`{m.__name__}`" for m in submodules), ""]
    attr_docs = _attr_docs(module)
    for name in public_names(module):
        obj = getattr(module, name, None)
        k = kind(obj)
        if k == "module":
            continue
        if k == "data" and name not in attr_docs:
            value = repr(obj)
            lines += [f".. py:data:: {name}", f"   :module: {module.__name__}", f"   :type: {type(obj).__name__}",
                      *([f"   :value: {value}"] if len(value) <= 80 and "\n" not in value else []), "",
                      f"   A constant of :py:mod:`{module.__name__}`"
                      + (f" (keys: {', '.join(f'``{k}``' for k in list(obj)[:8])})." if isinstance(obj, dict) else "."),
                      ""]
            continue
        home = homes.get(id(obj), module.__name__)
        if k == "data" or home == module.__name__:
            directive = {"class": "autoclass", "function": "autofunction", "data": "autodata"}[k]
            lines += [f".. {directive}:: {module.__name__}::{name}"]
            if k == "class":
                lines += ["   :members:", "   :show-inheritance:", *_inherited_option(obj)]
            if k == "data":
                lines += ["   :no-value:"]
            lines += [""]
            owner = _function_class(obj)
            if owner is not None:
                lines += [f"   ``{owner.__qualname__}.apply``: {_first_paragraph(owner)}", ""]
            names[id(obj)] = f"{module.__name__}.{name}"
        else:
            role = "class" if k == "class" else "func"
            target = f"{home}.{getattr(obj, '__name__', name)}" if k != "class" else f"{home}.{name}"
            # Name the target as documented at home (the exporter's own name for it).
            lines += [f".. py:{'class' if k == 'class' else 'function'}:: {name}", f"   :module: {module.__name__}",
                      "   :no-contents-entry:", "", f"   Same object as :py:{role}:`{target}`.", ""]
    return lines


def private_bases(cls: type) -> list[type]:
    """The bases of ``cls`` that are apex's own internal classes (mixins in ``_``-prefixed modules, or
    ``_``-prefixed classes): their public methods are ``cls``'s API, documented with it."""
    return [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "apex"
            and (is_internal(b.__module__) or b.__name__.startswith("_"))]


def _inherited_option(cls: type) -> list[str]:
    """``:inherited-members:`` up to the first base that is not apex's (``Optimizer``, ``Module``, ...), for a
    class that gets part of its API from internal bases; nothing for one that does not."""
    if not private_bases(cls):
        return []
    stop = next((b for b in cls.__mro__[1:] if b.__module__.split(".")[0] != "apex"), object)
    return [f"   :inherited-members: {stop.__name__}"]


def write_api_pages(out_dir: Path) -> list[str]:
    """Write one reference page per area and the compatibility-module page; return the page names."""
    w = walk()
    homes = _home_modules(w)
    # Document each object's home before any alias that points to it (the home is usually the package).
    by_area: dict[str, list[types.ModuleType]] = {a: [] for a in AREAS}
    for module in w.modules:
        by_area[_area(module.__name__)].append(module)
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = []
    documented: dict[int, str] = {}
    for area, modules in by_area.items():
        if not modules:
            continue
        lines = [".. This page is generated by docs/_apidoc.py at every build; do not edit.", "",
                 _underline(AREAS[area], "=")]
        for module in modules:
            lines += _module_section(module, homes, "-", documented)
        missing = sorted(n for n in w.failed if _area(n) == area and n.startswith("apex"))
        if missing:
            lines += [".. note::", "   Not importable in this build: " + ", ".join(f"``{n}``" for n in missing), ""]
        page = f"api/{area}"
        (out_dir / f"{area}.rst").write_text("\n".join(lines) + "\n")
        pages.append(page)
    (out_dir / "compat.rst").write_text("\n".join(compat_page(w)) + "\n")
    pages.append("api/compat")
    return pages


def _first_paragraph(obj: object) -> str:
    return (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")


def _target(obj: object) -> str:
    mod = getattr(obj, "__module__", None) or "?"
    return f"{mod}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def compat_page(w: Walk) -> list[str]:
    """The compatibility modules: a summary table generated from their tables, then each name's docs."""
    compat = importlib.import_module("apex._compat")
    lines = [".. This page is generated by docs/_apidoc.py at every build; do not edit.", "",
             _underline("Compatibility modules (reference)", "="),
             "Every module in ``apex._compat.MODULES``, with the names its table exports and where each "
             "resolves. See :doc:`/compat` for how they work.", "",
             ".. list-table::", "   :header-rows: 1", "   :widths: 25 75", "", "   * - module", "     - names", ""]
    by_name = {m.__name__: m for m in w.compat}
    for name in compat.MODULES:
        module = by_name.get(name)
        if module is None:
            cell = "*not available in this build*"
        else:
            cell = ", ".join(f":py:func:`~{name}.{n}`" for n in module.__all__)
        lines += [f"   * - ``{name}``", f"     - {cell}"]
    lines += [""]
    for module in w.compat:
        lines += [_underline(f"``{module.__name__}``", "-"), f".. py:module:: {module.__name__}", ""]
        first = _first_paragraph(module)
        if first:
            lines += [first, ""]
        for n in module.__all__:
            obj = getattr(module, n)
            lines += [f".. autofunction:: {module.__name__}::{n}", "", f"   Resolves to ``{_target(obj)}``.", ""]
    return lines
