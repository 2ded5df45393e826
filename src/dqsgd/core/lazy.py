"""Lazy package exports: a package's names are imported from their modules on first use.

A package ``__init__`` lists its exports once, as ordinary imports inside ``if TYPE_CHECKING:`` (so type
checkers and editors see the real names and types), and calls :func:`attach`. At run time that block is
skipped; :func:`attach` reads it from the package's source and returns a module ``__getattr__`` that
imports a name's module only when the name is first asked for. ``import dqsgd.codecs`` therefore costs
nothing until a codec is used (the compiled kernels load numba, about half a second), and the command
line's ``--help`` never loads torch.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path
from typing import Any, Callable


def _exports(package: str, init_file: str) -> dict[str, str]:
    """name -> absolute module, from the ``from M import a, b`` lines under ``if TYPE_CHECKING:``."""
    tree = ast.parse(Path(init_file).read_text(), init_file)
    table: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                if not isinstance(imp, ast.ImportFrom) or imp.module is None:
                    raise TypeError(f"{init_file}: only `from MODULE import NAME` lines belong in the TYPE_CHECKING block")
                module = imp.module if imp.level == 0 else f"{package}.{imp.module}"
                table.update({a.asname or a.name: f"{module}:{a.name}" for a in imp.names})
    return table


def attach(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package`` whose ``__init__`` is ``init_file``."""
    table = _exports(package, init_file)

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = where.split(":")
        value = getattr(importlib.import_module(module), attr)
        setattr(sys.modules[package], name, value)  # later lookups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__, sorted(table)
