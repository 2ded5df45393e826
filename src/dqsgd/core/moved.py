"""The old import paths of moved modules: each is the moved module itself, not a copy.

:data:`MOVED` maps an old dotted path to the module's home. :func:`install` (run by ``import dqsgd``)
puts one finder first on ``sys.meta_path``; asked for an old path, it imports the new module and
registers that very object under the old name too. So ``import dqsgd.methods`` gives
``dqsgd.method.config``: its classes, its registry and a test's monkeypatch are shared, and pickles
that name the old path load. ``python -m OLD`` runs the new module's code as ``__main__``.

A module that moves adds one line here; nothing is left at its old place in the source tree.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

MOVED: dict[str, str] = {
    "dqsgd._extras": "dqsgd.core.extras",
    "dqsgd._lazy": "dqsgd.core.lazy",
    "dqsgd.bench": "dqsgd.cli.bench.common",
    "dqsgd.bench_cli": "dqsgd.cli.bench.parser",
    "dqsgd.bench_fsdp": "dqsgd.cli.bench.fsdp",
    "dqsgd.bench_gpu": "dqsgd.cli.bench.gpu",
    "dqsgd.bench_gpu_cli": "dqsgd.cli.bench.gpu_parser",
    "dqsgd.bench_hook": "dqsgd.cli.bench.hook",
    "dqsgd.bench_loopback": "dqsgd.cli.bench.loopback",
    "dqsgd.config": "dqsgd.core.config_file",
    "dqsgd.errors": "dqsgd.core.errors",
    "dqsgd.experiments.theory": "dqsgd.theory",
    "dqsgd.experiments.theory.__main__": "dqsgd.theory.__main__",
    "dqsgd.experiments.theory.bounds": "dqsgd.theory.bounds",
    "dqsgd.experiments.theory.checks": "dqsgd.theory.checks",
    "dqsgd.experiments.theory.cli": "dqsgd.theory.cli",
    "dqsgd.experiments.theory.plots": "dqsgd.theory.plots",
    "dqsgd.experiments.theory.report": "dqsgd.theory.report",
    "dqsgd.experiments.theory.settings": "dqsgd.theory.settings",
    "dqsgd.experiments.theory.sims": "dqsgd.theory.sims",
    "dqsgd.integrations": "dqsgd.ddp",
    "dqsgd.integrations.ddp_codec": "dqsgd.topology.payloads",
    "dqsgd.integrations.ddp_hook": "dqsgd.ddp.comm_hook",
    "dqsgd.integrations.ddp_state": "dqsgd.ddp.state",
    "dqsgd.launch": "dqsgd.cli.launch",
    "dqsgd.ledger": "dqsgd.method.ledger",
    "dqsgd.local": "dqsgd.train.local_sgd",
    "dqsgd.memory": "dqsgd.method.memory",
    "dqsgd.methods": "dqsgd.method.config",
    "dqsgd.pipeline": "dqsgd.method.pipeline",
    "dqsgd.plan": "dqsgd.cli.plan",
    "dqsgd.rng": "dqsgd.core.rng",
    "dqsgd.sharding": "dqsgd.core.sharding",
    "dqsgd.sketched": "dqsgd.topology.sketched",
    "dqsgd.step": "dqsgd.topology.step",
    "dqsgd.timeouts": "dqsgd.core.timeouts",
    "dqsgd.transport.launch": "dqsgd.cli.launch",
}
# Two old modules became packages of the same name, which export the old module's names:
# ``dqsgd.cli`` (from dqsgd.cli.commands) and ``dqsgd.theory`` (from dqsgd.theory.formulas).
BECAME_PACKAGES: dict[str, str] = {"dqsgd.cli": "dqsgd.cli.commands", "dqsgd.theory": "dqsgd.theory.formulas"}


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and loads each as its new module."""

    def __init__(self, moved: dict[str, str]) -> None:
        self.moved = moved
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = self.moved.get(name)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.moved[spec.name])
        self._specs[module.__name__] = module.__spec__  # the import system sets __spec__ to the old path's
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)  # the module keeps its own spec

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code (``python -m OLD`` runs it as ``__main__``)."""
        real = importlib.util.find_spec(self.moved[fullname])
        loader = real.loader if real is not None else None
        return loader.get_code(real.name) if isinstance(loader, importlib.abc.InspectLoader) else None


def install() -> None:
    """Put the old-path finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPaths(MOVED))
