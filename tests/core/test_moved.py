"""Old import paths of moved modules: each is the moved module object itself (dqsgd.core.moved)."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import dqsgd
from dqsgd.core.moved import BECAME_PACKAGES, MOVED

SRC = Path(dqsgd.__file__).parent


@pytest.mark.parametrize("old", sorted(m for m in MOVED if not m.endswith(".__main__")))  # __main__: by python -m
def test_an_old_path_is_the_new_module(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new
    assert sys.modules[old] is new
    assert new.__name__ == MOVED[old] and new.__spec__.name == MOVED[old]  # the module keeps its own name


def test_an_old_package_path_leaves_its_new_package_intact() -> None:
    """The import system sets an old child on its (moved, so shared) package object under the old leaf
    name: that name must not be one of the new package's modules or exports, or it would replace it."""
    def taken(package: str, leaf: str) -> bool:
        where = SRC.parent / package.replace(".", "/")
        return (where / f"{leaf}.py").exists() or (where / leaf).is_dir() or \
            leaf in getattr(importlib.import_module(package), "__all__", ())

    clashes = [old for old in MOVED if old.rsplit(".", 1)[0] in MOVED
               and old.rsplit(".", 1)[1] != MOVED[old].rsplit(".", 1)[1]
               and taken(MOVED[old.rsplit(".", 1)[0]], old.rsplit(".", 1)[1])]
    assert clashes == []
    for old in MOVED:
        if not old.endswith(".__main__"):
            importlib.import_module(old)
    for new in MOVED.values():
        package, leaf = new.rsplit(".", 1)
        if new in sys.modules and package in sys.modules:
            assert getattr(sys.modules[package], leaf) is sys.modules[new], new


def test_no_file_is_left_at_an_old_path() -> None:
    left = [old for old in MOVED
            if (SRC.parent / (old.replace(".", "/") + ".py")).exists()
            or (SRC.parent / old.replace(".", "/") / "__init__.py").exists()]
    assert left == []


@pytest.mark.parametrize("package", sorted(BECAME_PACKAGES))
def test_a_module_that_became_a_package_exports_its_names(package: str) -> None:
    pkg, module = importlib.import_module(package), importlib.import_module(BECAME_PACKAGES[package])
    public = [n for n in getattr(module, "__all__", None) or vars(module) if not n.startswith("_")
              and getattr(getattr(module, n), "__module__", None) == module.__name__]
    assert public and all(getattr(pkg, n) is getattr(module, n) for n in public)


def test_old_attribute_access_and_monkeypatching_reach_the_one_module(monkeypatch: pytest.MonkeyPatch) -> None:
    import dqsgd.launch
    import dqsgd.methods
    from dqsgd.cli import launch

    monkeypatch.setattr(dqsgd.launch, "spawn_local", "patched")
    assert launch.spawn_local == "patched"
    assert dqsgd.methods.METHODS is importlib.import_module("dqsgd.method.config").METHODS


def test_a_pickle_naming_an_old_path_loads() -> None:
    from dqsgd.method.config import method_config

    config = method_config("qsgd", bits=4)
    old = pickle.dumps(config, protocol=0).replace(b"dqsgd.method.config", b"dqsgd.methods")
    assert b"dqsgd.methods" in old and pickle.loads(old) == config


def test_python_m_runs_an_old_path() -> None:
    out = subprocess.run([sys.executable, "-m", "dqsgd.experiments.theory", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout
