"""Griffe extension: read the repository's top-level ``kernels/`` as ``pagedstash_func.kernels``.

pyproject.toml installs ``kernels/`` as the subpackage ``pagedstash_func.kernels``
(``[tool.setuptools] package-dir``), so the folder is not under ``pagedstash_func/``, where
griffe's static analysis looks for submodules: ``from . import kernels`` in
``pagedstash_func/__init__.py`` would stay an alias to nothing, and ``mkdocs build --strict``
fails on it. Once ``pagedstash_func`` is loaded, this extension visits ``kernels/*.py``
statically (no import: the custom ops' docstrings and signatures are those of the decorated
functions in the files) and puts the result in place of that alias.

``kernels/__init__.py`` sets its ``__all__`` under ``if __name__ == "pagedstash_func.kernels":``
(and an empty one in the ``else`` branch, for a stray bare ``import kernels``); a static visit
sees both assignments and keeps the last, so the exports are taken from the installed branch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import griffe


class InstalledSubpackage(griffe.Extension):
    """Attach the folder ``path`` (relative to the repository root) as ``module``, a direct
    subpackage of a top-level package."""

    def __init__(self, module: str = "pagedstash_func.kernels", path: str = "kernels"):
        super().__init__()
        self.parent_path, _, self.name = module.rpartition(".")
        self.path = path

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        """The hook of griffe >= 2 (griffe 1 names it `on_package_loaded`)."""
        if pkg.path != self.parent_path:     # a subpackage of a top-level package only
            return
        parent = pkg
        root = Path(pkg.filepath).parent.parent       # pagedstash_func/__init__.py -> the repo
        folder = root / self.path
        current = parent.members.get(self.name)
        if current is not None and not current.is_alias \
                and current.filepath == folder / "__init__.py":
            return                           # attached already (both hooks fired)
        module = self._visit(self.name, folder / "__init__.py", parent, loader)
        files = {f.stem: f for f in sorted(folder.glob("*.py")) if f.name != "__init__.py"}
        subs = {name: self._visit(name, f, module, loader) for name, f in files.items()}
        for name, sub in subs.items():
            if name not in module.members:
                module.set_member(name, sub)
        # Where ``__init__.py`` binds a submodule's name to something else (``from .stash_copy
        # import stash_copy``: at run time the op replaces the submodule as that attribute),
        # keep that binding, and point every alias into such a submodule at the object itself,
        # since its dotted path now runs through the op rather than the submodule.
        for name, member in list(module.members.items()):
            if member.is_alias and member.target_path.startswith(module.path + "."):
                sub, _, rest = member.target_path[len(module.path) + 1:].partition(".")
                if rest and sub in subs and module.members.get(sub) is not subs[sub]:
                    module.set_member(name, griffe.Alias(name, subs[sub][rest], parent=module,
                                                         lineno=member.alias_lineno,
                                                         endlineno=member.alias_endlineno))
        exports = _installed_exports(folder / "__init__.py", module.path)
        if exports is not None:
            module.exports = exports
        parent.set_member(self.name, module)
        loader.expand_exports(module)

    on_package_loaded = on_package

    @staticmethod
    def _visit(name: str, file: Path, parent: griffe.Module,
               loader: griffe.GriffeLoader) -> griffe.Module:
        code = file.read_text(encoding="utf-8")
        loader.lines_collection[file] = code.splitlines()
        return griffe.visit(name, filepath=file, code=code, parent=parent,
                            extensions=loader.extensions,
                            docstring_parser=loader.docstring_parser,
                            docstring_options=loader.docstring_options,
                            lines_collection=loader.lines_collection,
                            modules_collection=loader.modules_collection)


def _installed_exports(init: Path, dotted: str) -> list[str] | None:
    """The ``__all__`` assigned under ``if __name__ == "<dotted>":``, or ``None`` if none is."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) \
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__" \
                and [getattr(c, "value", None) for c in node.test.comparators] == [dotted]:
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and [getattr(t, "id", None)
                                                     for t in stmt.targets] == ["__all__"]:
                    return list(ast.literal_eval(stmt.value))
    return None
