"""Generate ``tests/upstream_names.json``: the names NVIDIA Apex's package ``__init__.py`` files bind, per
package, read from Apex's source text at two revisions (e13873de, the last with amp and transformer, and the
newest one in the given copy), for ``tests/test_upstream_names.py``.

    python -m tests.gen_upstream_names --repo PATH/TO/NVIDIA-apex.git [--rev e13873de --rev HEAD]

``--repo`` is any git copy of NVIDIA/apex (a bare or mirror clone is enough); nothing is imported from it.
A package's names are what its ``__init__.py`` binds at the top level (inside ``if``/``try`` too):

* every name imported from Apex itself (``from .x import y``, ``from apex.x import y as z``, ``from . import
  sub``), private ones included (clients import e.g. ``schedules._forward_backward_pipelining_with_interleaving``);
* public names it defines (``def``, ``class``, assignments);
* for ``from .x import *``, the public names module ``x`` defines or imports from Apex (or its ``__all__``).

Names bound by ``import torch`` and the like, or imported from other libraries, are not Apex's API and
are left out. A package is listed under every revision that has it, and its names are the union.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_names.json")
DEFAULT_REVS = ("e13873de", "HEAD")


class Source:
    def __init__(self, repo: str, rev: str) -> None:
        self.repo, self.rev = repo, rev
        self.sha = self._git("rev-parse", f"{rev}^{{commit}}").strip()
        self.files = set(self._git("ls-tree", "-r", "--name-only", self.sha, "apex").split())

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", self.repo, *args], capture_output=True, text=True,
                              check=True).stdout

    def read(self, path: str) -> str:
        return self._git("show", f"{self.sha}:{path}")

    def module_path(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        for p in (f"{base}/__init__.py", f"{base}.py"):
            if p in self.files:
                return p
        return None


def _resolve(package: str, node: ast.ImportFrom) -> str | None:
    """The absolute module of ``from <module> import ...`` inside ``package``; None outside Apex."""
    if node.level:
        parts = package.split(".")
        base = parts[: len(parts) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))
    if node.module and (node.module == "apex" or node.module.startswith("apex.")):
        return node.module
    return None


def _statements(body):
    """Top-level statements, descending into ``if``/``try``/``with`` blocks (conditional imports)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and hasattr(node, field):
                yield from _statements(getattr(node, field))
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                yield from _statements(handler.body)


def _defined(node) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AnnAssign, ast.AugAssign)) else []
    names = []

    def bound(t) -> None:  # ``a = ``, ``a, b = ``; not ``torch.compile = `` (an attribute of another module)
        if isinstance(t, ast.Name):
            names.append(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                bound(e)

    for t in targets:
        bound(t)
    return names


def _all_list(tree) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def names_of(src: Source, module: str, *, star: bool = False, seen=frozenset()) -> set[str]:
    """The Apex names module ``module`` binds (public ones only when ``star``, as ``import *`` sees them)."""
    path = src.module_path(module)
    if path is None or module in seen:
        return set()
    tree = ast.parse(src.read(path))
    if star and (explicit := _all_list(tree)) is not None:
        return set(explicit)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in _statements(tree.body):
        if isinstance(node, ast.ImportFrom):
            origin = _resolve(package, node)
            if origin is None:
                continue
            for alias in node.names:
                if alias.name == "*":
                    names |= names_of(src, origin, star=True, seen=seen | {module})
                else:
                    names.add(alias.asname or alias.name)
        else:
            names.update(n for n in _defined(node) if not n.startswith("_"))
    if star:
        names = {n for n in names if not n.startswith("_")}
    return names


def generate(repo: str, revs=DEFAULT_REVS) -> dict:
    table: dict[str, dict] = {}
    revisions = {}
    for rev in revs:
        src = Source(repo, rev)
        revisions[rev] = src.sha
        for path in sorted(src.files):
            if not path.endswith("/__init__.py") or "/test" in path:
                continue
            package = path[: -len("/__init__.py")].replace("/", ".")
            entry = table.setdefault(package, {"revisions": [], "names": []})
            entry["revisions"].append(rev)
            entry["names"] = sorted(set(entry["names"]) | names_of(src, package))
    return {"source": "NVIDIA/apex", "revisions": revisions, "generator": "tests/gen_upstream_names.py",
            "packages": dict(sorted(table.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", required=True, help="a git copy of NVIDIA/apex (bare or not)")
    ap.add_argument("--rev", action="append", help="revisions to read (default: e13873de and HEAD)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    repo = args.repo if os.path.basename(args.repo.rstrip("/")).endswith(".git") or os.path.isfile(
        os.path.join(args.repo, "HEAD")) else os.path.join(args.repo, ".git")
    table = generate(repo, tuple(args.rev or DEFAULT_REVS))
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"{args.out}: {len(table['packages'])} packages, "
          f"{sum(len(p['names']) for p in table['packages'].values())} names")


if __name__ == "__main__":
    main()
