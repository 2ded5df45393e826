"""The package's layers import downward only: a module may import its own layer or lower ones.

Read bottom to top, one training step goes trainer → step → method (quantizer registry, codec) →
transport → policy; a lower layer never reaches up (imports under ``if TYPE_CHECKING:`` are
annotations only and do not count). ``dqsgd.transport.launch`` is the old import path of
``dqsgd.launch`` (a command-line launcher) and is kept working as an alias of that module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dqsgd

SRC = Path(dqsgd.__file__).parent
LAYERS: list[list[str]] = [  # lowest first
    ["dqsgd._lazy", "dqsgd._extras", "dqsgd.errors", "dqsgd.rng", "dqsgd.sharding", "dqsgd.methods"],
    ["dqsgd.quantizers"],
    ["dqsgd.codecs"],
    ["dqsgd.kernels"],
    ["dqsgd.policies", "dqsgd.ledger", "dqsgd.memory", "dqsgd.theory"],
    ["dqsgd.pipeline", "dqsgd.api", "dqsgd.step"],
    ["dqsgd.transport"],
    ["dqsgd.data", "dqsgd.models"],
    ["dqsgd.train", "dqsgd.integrations", "dqsgd.ddp", "dqsgd.dq"],
    ["dqsgd.experiments", "dqsgd.launch", "dqsgd.bench", "dqsgd.bench_cli", "dqsgd.bench_hook", "dqsgd.cli",
     "dqsgd.__main__"],
]
THEORY = "dqsgd.experiments.theory"
THEORY_LAYERS: list[list[str]] = [  # the theory checks' modules, lowest first
    [f"{THEORY}.settings"],
    [f"{THEORY}.sims"],
    [f"{THEORY}.bounds", f"{THEORY}.plots", f"{THEORY}.report"],
    [f"{THEORY}.checks"],
    [f"{THEORY}.cli"],
    [f"{THEORY}.__main__"],
]
ALIASES = {"dqsgd.transport.launch"}  # old import paths kept as aliases of a moved module


def layer_of(module: str, layers: list[list[str]] = LAYERS) -> int | None:
    if module == "dqsgd" and layers is LAYERS:  # the package root: lazy re-exports of the public API, the top
        return len(LAYERS) - 1
    best: tuple[int, int] | None = None
    for i, names in enumerate(layers):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > best[1]):
                best = (i, len(n))
    return None if best is None else best[0]


def runtime_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(module, line) of every ``dqsgd`` import outside ``if TYPE_CHECKING:`` blocks."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "dqsgd":
                found.extend((f"dqsgd.{a.name}", node.lineno) for a in node.names if a.name != "__version__")
            elif node.module.startswith("dqsgd."):
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.startswith("dqsgd."))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("dqsgd."):
                found.append((arg.value, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def modules() -> list[tuple[str, Path]]:
    out = []
    for f in sorted(SRC.rglob("*.py")):
        parts = ("dqsgd", *f.relative_to(SRC).with_suffix("").parts)
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), f))
    return out


def test_every_module_has_a_layer() -> None:
    assert [m for m, _ in modules() if layer_of(m) is None] == []


def upward_imports(layers: list[list[str]]) -> list[str]:
    up = []
    for module, path in modules():
        if module in ALIASES:
            continue
        me = layer_of(module, layers)
        for target, line in runtime_imports(ast.parse(path.read_text(), str(path))):
            there = layer_of(target, layers)
            if there is not None and me is not None and there > me:
                up.append(f"{module}:{line} imports {target} (layer {there} > {me})")
    return up


def test_no_import_points_up() -> None:
    assert upward_imports(LAYERS) == []


def test_theory_checks_read_in_one_direction() -> None:
    """Settings, then the simulations, then bounds/plots/report, then the checks, then the command."""
    mine = [m for m, _ in modules() if m.startswith(THEORY + ".")]
    assert mine and [m for m in mine if layer_of(m, THEORY_LAYERS) is None] == []
    assert upward_imports(THEORY_LAYERS) == []


def test_the_check_catches_an_upward_import() -> None:
    tree = ast.parse("from dqsgd.train.runner import run_one\nif TYPE_CHECKING:\n    from dqsgd.cli import main\n")
    assert runtime_imports(tree) == [("dqsgd.train.runner", 1)]
    assert layer_of("dqsgd.train.runner") > layer_of("dqsgd.transport.base")


def test_old_launch_path_is_the_same_module() -> None:
    import dqsgd.launch
    import dqsgd.transport.launch

    assert dqsgd.transport.launch is dqsgd.launch
