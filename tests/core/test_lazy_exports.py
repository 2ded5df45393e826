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
