"""The project modules a module imports, directly or through others (static, from the source's AST).

Used by tasks/run/dvc_yaml.py to list as each DVC stage's deps the code that can change its outputs.
Rules (an over-approximation of what runs, except for package ``__init__`` files):
- every ``import``/``from ... import`` in the file counts, also inside functions (lazy imports run too);
- ``from package import name`` follows ``name`` to the module that defines it (the package's own re-export,
  or the submodule of that name), not the whole ``__init__``: a package ``__init__`` that re-exports every
  trainer would otherwise make each stage depend on all of them;
- a package that exports its names lazily (``rlhf_core._lazy``: PEP 562 ``__getattr__``) is resolved through
  ``exports`` (public name -> defining module);
- only modules of ``packages`` (project packages) are followed; third-party imports are not.
"""

from __future__ import annotations

import ast
from pathlib import Path


class ImportGraph:
    def __init__(self, root: Path, packages: tuple[str, ...], exports: dict[str, str] | None = None):
        self.root, self.packages, self.exports = root, packages, exports or {}

    # ------------------------------------------------------------------ module names <-> files

    def file_of(self, module: str) -> Path | None:
        """``a/b.py`` or ``a/b/__init__.py`` of ``a.b`` inside the project, else None."""
        if module.split(".")[0] not in self.packages:
            return None
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def module_of(self, path: Path) -> str:
        parts = path.relative_to(self.root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    # ------------------------------------------------------------------ one file's imports

    def imports_of(self, path: Path) -> set[str]:
        """Project modules ``path`` imports (package ``__init__`` files resolved through to the definitions)."""
        tree = ast.parse(path.read_text(), filename=str(path))
        package = self.module_of(path) if path.name == "__init__.py" else self.module_of(path).rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found |= self._module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node, package)
                for alias in node.names:
                    found |= self._from(base, alias.name)
        return found

    def _absolute(self, node: ast.ImportFrom, package: str) -> str:
        if not node.level:
            return node.module or ""
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join([*parts, node.module] if node.module else parts)

    def _module(self, module: str) -> set[str]:
        """``import a.b.c``: the module itself (its parent packages' ``__init__`` only re-export)."""
        path = self.file_of(module)
        if path is None:
            return set()
        return self._through_init(module, None) if path.name == "__init__.py" else {module}

    def _from(self, base: str, name: str) -> set[str]:
        """``from base import name``: the submodule ``base.name``, or the module defining ``name``."""
        if self.file_of(f"{base}.{name}") is not None:
            return self._module(f"{base}.{name}")
        path = self.file_of(base)
        if path is None:
            return set()
        return self._through_init(base, name) if path.name == "__init__.py" else {base}

    def _through_init(self, package: str, name: str | None) -> set[str]:
        """What a package ``__init__`` re-exports as ``name`` (every re-export when ``name`` is None or ``*``),
        plus the ``__init__`` itself when it defines anything of its own."""
        path = self.file_of(package)
        tree = ast.parse(path.read_text(), filename=str(path))
        found: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                base = self._absolute(node, package)
                for alias in node.names:
                    if name in (None, "*") or (alias.asname or alias.name) == name:
                        found |= self._from(base, alias.name)
            elif isinstance(node, ast.Import):
                continue
            elif not _is_docstring_or_all(node):
                found.add(package)  # code of its own runs on import
        lazy = self.exports.get(name or "")
        if lazy is not None and lazy.startswith(package + "."):  # exported on first access (PEP 562)
            found |= self._module(lazy)
        return found if found or name is None else {package}

    # ------------------------------------------------------------------ the closure

    def closure(self, module: str, stop: frozenset[str] = frozenset()) -> set[str]:
        """``module`` and every project module it reaches through imports; the modules in ``stop`` are reached
        but not followed (a table that names every stage's body: one stage's code is not another's)."""
        seen, todo = set(), [module]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            path = self.file_of(current)
            if path is not None and current not in stop:
                todo.extend(self.imports_of(path) - seen)
        return seen

    def files(self, modules: set[str]) -> set[str]:
        return {self.file_of(m).relative_to(self.root).as_posix() for m in modules if self.file_of(m) is not None}


def _is_docstring_or_all(node: ast.stmt) -> bool:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return True
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
