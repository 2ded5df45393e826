"""Lazy package exports (dqsgd.core.lazy): every listed name resolves to the object of its module."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from dqsgd.core.lazy import _exports

PACKAGES = ["dqsgd.codecs", "dqsgd.kernels", "dqsgd.quantizers", "dqsgd.policies", "dqsgd.dq"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_export_resolves_to_its_module_object(package: str) -> None:
    pkg = importlib.import_module(package)
    table = _exports(package, pkg.__file__)
    assert sorted(table) == pkg.__all__ and len(table) >= 5
    for name, where in table.items():
        module, attr = where.split(":")
        assert getattr(pkg, name) is getattr(importlib.import_module(module), attr)
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        getattr(pkg, "no_such_name")


def test_importing_a_package_loads_none_of_its_modules() -> None:
    code = ("import sys, dqsgd.codecs, dqsgd.kernels, dqsgd.dq\n"
            "print(sorted(m for m in sys.modules if m.startswith(('dqsgd.codecs.', 'dqsgd.kernels.', 'dqsgd.dq.'))),"
            " 'numba' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[] False False"


def test_star_import_and_a_refused_block(tmp_path: Path) -> None:
    ns: dict = {}
    exec("from dqsgd.policies import *", ns)
    assert "BudgetedDQSGD" in ns and "FixedBits" in ns
    bad = tmp_path / "__init__.py"
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import os\n")
    with pytest.raises(TypeError, match="from MODULE import NAME"):
        _exports("pkg", str(bad))


def test_importing_dqsgd_leaves_the_import_system_alone() -> None:
    """No import hook: ``sys.meta_path`` and ``sys.path_hooks`` are the same objects before and after
    importing the package and its public modules; ``dqsgd.local`` is a module of its own (a file)."""
    code = ("import sys\nbefore = (list(sys.meta_path), list(sys.path_hooks))\n"
            "import dqsgd, dqsgd.local\n"
            "after = (list(sys.meta_path), list(sys.path_hooks))\n"
            "print(all(len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(before, after)),"
            " dqsgd.local.__spec__.origin.endswith('local.py'), dqsgd.local.LocalSGDOptimizer.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["True", "True", "LocalSGDOptimizer"]
