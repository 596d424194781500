"""Import cycles among tierstore's files and folders, as Python runs them.

    python scripts/import_cycles.py [--lazy] [ROOT]

Reads every module of the ``tierstore`` package and of the backend plugins under
``backends/`` (under ROOT, default the repository) and follows the imports that run when a
module is imported: module-level ``import`` and ``from ... import`` statements, those under
``if TYPE_CHECKING:`` excluded (they import nothing at run time). Prints each cycle between
files and between folders (a folder: the package a module sits in, ``tierstore.tiers``), and
exits 1 if there is one. With ``--lazy``, imports inside functions count too (they run on
first call, so a cycle through one is not an import-time error, but it still ties the two
files together). ``make lint`` runs it with ``--lazy``; import-linter's layers contract checks the
order between folders, this the files within one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    bases = [root, *sorted(p.parent for p in root.glob("backends/*/pyproject.toml"))]
    for base in bases:
        for path in sorted(base.glob("tierstore*/**/*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, known: set[str], lazy: bool) -> set[str]:
    """The modules of ``known`` that importing ``name`` imports at once."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in known else base)
            elif isinstance(node, ast.If) and not _is_type_checking(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)) or (
                lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            ):
                visit(node.body)  # a class body runs at import; a function's only when called
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text(), str(path)).body)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def main(argv: list[str]) -> int:
    lazy = "--lazy" in argv
    args = [a for a in argv[1:] if a != "--lazy"]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    modules = _modules(root)
    known = set(modules)
    files = {name: _imports(name, path, known, lazy) for name, path in modules.items()}
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}

    def folder(name: str) -> str:
        return name if name in packages else name.rpartition(".")[0]

    folders: dict[str, set[str]] = {}
    for name, targets in files.items():
        here = folder(name)
        # A package's __init__ importing its own modules is not a cycle between folders.
        folders.setdefault(here, set()).update(
            folder(t) for t in targets if folder(t) != here and not folder(t).startswith(here + ".")
        )
    top = {name for name in folders if "." not in name}
    for name in top:  # the top-level package re-exports everything: not a layer of its own
        folders[name] = set()
    file_cycles, folder_cycles = _cycles(files), _cycles(folders)
    for kind, cycles in (("file", file_cycles), ("folder", folder_cycles)):
        for cycle in cycles:
            print(f"{kind} cycle: {' <-> '.join(cycle)}")
    print(f"{len(modules)} modules: {len(file_cycles)} file cycle(s), {len(folder_cycles)} folder cycle(s)")
    return 1 if file_cycles or folder_cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
