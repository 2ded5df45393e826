"""The package's layers import downward only: a module may import its own layer or lower ones.

Two more rules keep the package to its public ground: numba kernels are defined only in the codecs and
kernels, and no module reaches a private name of torch beyond the one listed use (the benchmarks that
compare against PyTorch's private quantization backend, or time the fused kernel's pieces with a kernel
of their own, live in ``benchmarks/``, outside the package). And the shape of the package: no import
cycle, no private module or name used across packages, no module over :data:`MAX_LINES` lines.

Read bottom to top, one training step goes trainer → topology step → method (quantizer registry, codec)
→ transport → policy; a lower layer never reaches up (imports under ``if TYPE_CHECKING:`` are
annotations only and do not count). Old import paths of moved modules are not files: they are the table
of :mod:`dqsgd.core.moved` (tests/core/test_moved.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import dqsgd

SRC = Path(dqsgd.__file__).parent
LAYERS: list[list[str]] = [  # lowest first; a module's layer is that of its longest listed prefix
    ["dqsgd.core", "dqsgd.topology.names", "dqsgd.topology.agreement"],
    ["dqsgd.quantizers"],
    ["dqsgd.codecs"],
    ["dqsgd.kernels"],
    ["dqsgd.policies", "dqsgd.method.config", "dqsgd.method.memory", "dqsgd.method.ledger", "dqsgd.theory.formulas",
     "dqsgd.topology.traffic", "dqsgd.topology.limits", "dqsgd.topology.keys"],
    ["dqsgd.method", "dqsgd.api", "dqsgd.topology"],  # topology: the per-bucket protocol and the step objects
    ["dqsgd.transport"],
    ["dqsgd.data", "dqsgd.models"],
    ["dqsgd.train", "dqsgd.ddp", "dqsgd.dq", "dqsgd.fsdp"],
    ["dqsgd.experiments", "dqsgd.theory", "dqsgd.cli", "dqsgd.dq.cli", "dqsgd.dq.__main__", "dqsgd.__main__"],
]
THEORY = "dqsgd.theory"
THEORY_LAYERS: list[list[str]] = [  # the theory package's modules, lowest first
    [f"{THEORY}.formulas"],
    [f"{THEORY}.settings"],
    [f"{THEORY}.sims"],
    [f"{THEORY}.bounds", f"{THEORY}.plots", f"{THEORY}.report"],
    [f"{THEORY}.checks"],
    [f"{THEORY}.cli"],
    [f"{THEORY}.__main__"],
]
BENCH = "dqsgd.cli.bench"
BENCH_LAYERS: list[list[str]] = [  # the bench commands, lowest first: the parsers load a benchmark when it runs
    [f"{BENCH}.choices"],
    [f"{BENCH}.common", f"{BENCH}.hook", f"{BENCH}.fsdp"],
    [f"{BENCH}.loopback", f"{BENCH}.contention"],
    [f"{BENCH}.gpu"],
    [f"{BENCH}.gpu_parser"],
    [f"{BENCH}.parser"],
]
MAX_LINES = 450


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
        me = layer_of(module, layers)
        for target, line in runtime_imports(ast.parse(path.read_text(), str(path))):
            there = layer_of(target, layers)
            if there is not None and me is not None and there > me:
                up.append(f"{module}:{line} imports {target} (layer {there} > {me})")
    return up


def test_no_import_points_up() -> None:
    assert upward_imports(LAYERS) == []


def test_theory_reads_in_one_direction() -> None:
    """The formulas, the settings, the simulations, then bounds/plots/report, the checks, the command."""
    mine = [m for m, _ in modules() if m.startswith(THEORY + ".")]
    assert mine and [m for m in mine if layer_of(m, THEORY_LAYERS) is None] == []
    assert upward_imports(THEORY_LAYERS) == []


def test_bench_commands_read_in_one_direction() -> None:
    """The shared choices, the benchmarks, then the parsers that load them."""
    mine = [m for m, _ in modules() if m.startswith(BENCH + ".")]
    assert mine and [m for m in mine if layer_of(m, BENCH_LAYERS) is None] == []
    assert upward_imports(BENCH_LAYERS) == []


def test_no_module_is_over_the_line_limit() -> None:
    long = {m: n for m, path in modules() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_check_catches_an_upward_import() -> None:
    tree = ast.parse("from dqsgd.train.runner import run_one\nif TYPE_CHECKING:\n    from dqsgd.cli import main\n")
    assert runtime_imports(tree) == [("dqsgd.train.runner", 1)]
    assert layer_of("dqsgd.train.runner") > layer_of("dqsgd.transport.base")


KERNEL_HOMES = ("dqsgd.codecs", "dqsgd.kernels")
TORCH_PRIVATES_USED = {  # module: the private torch names it reaches, each guarded where it is used
    # the rendezvous store of the default group, read for peers' error reports (best effort: None on failure)
    "dqsgd.transport.torch_dist": ["dist…_get_default_store"],
    # FSDP2's ReduceScatter interface class (torch exports no public name for it; absent: compress() says so)
    "dqsgd.fsdp.comm": ["torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter"],
    # torch._dynamo's counters: bench gpu reports the recompilations seen after warm-up
    "dqsgd.cli.bench.loopback": ["torch…_dynamo"],
    # the autograd engine's end-of-backward callback: the hook raises a bucket's error there, with its type
    "dqsgd.ddp.comm_hook": ["torch…_execution_engine"],
}


def numba_kernels(tree: ast.Module) -> list[tuple[str, int]]:
    """(function, line) of every function compiled by numba (``@numba.njit``, ``@njit(...)``, ``@numba.vectorize`` ...)."""
    def is_numba(d: ast.expr) -> bool:
        d = d.func if isinstance(d, ast.Call) else d
        if isinstance(d, ast.Attribute) and isinstance(d.value, ast.Name):
            return d.value.id == "numba"
        return isinstance(d, ast.Name) and d.id in {"njit", "jit", "vectorize", "guvectorize", "cfunc"}

    return [(n.name, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and any(is_numba(d) for d in n.decorator_list)]


def torch_privates(tree: ast.Module) -> list[tuple[str, int]]:
    """(dotted name, line) of every private torch name the code reaches: ``import torch._x``,
    ``from torch.y import _x``, or ``a._x`` where ``a`` is bound by an import from torch."""
    def private(part: str) -> bool:
        return part.startswith("_") and not part.endswith("__")

    found, torch_names = [], set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
                    found += [(a.name, n.lineno)] if any(map(private, a.name.split("."))) else []
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "torch":
            for a in n.names:
                torch_names.add(a.asname or a.name)
                path = f"{n.module}.{a.name}"
                found += [(path, n.lineno)] if any(map(private, path.split("."))) else []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and private(n.attr):
            root = n.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                found.append((f"{root.id}…{n.attr}", n.lineno))
    return found


def test_numba_kernels_live_in_the_codecs_and_kernels() -> None:
    stray = [f"{m}:{line} {fn}" for m, path in modules() if not m.startswith(KERNEL_HOMES)
             for fn, line in numba_kernels(ast.parse(path.read_text(), str(path)))]
    assert stray == []


def test_no_module_reaches_a_private_torch_name_beyond_the_listed_one() -> None:
    found: dict[str, list[str]] = {}
    for m, path in modules():
        names = [name for name, _ in torch_privates(ast.parse(path.read_text(), str(path)))]
        if names:
            found[m] = names
    assert found == TORCH_PRIVATES_USED


def test_the_checks_catch_a_kernel_and_a_private_torch_call() -> None:
    code = (
        "import numba\nimport torch\nfrom torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh\n"
        "from torch._dynamo import config\n"
        "@numba.njit(cache=True)\ndef k(x):\n    return x\n"
        "def f(t, s, z):\n    torch.__version__\n    torch.ao.quantization.MinMaxObserver()\n"
        "    return qh._dequantize_per_tensor_backend(t, s, z), torch._C._get_tracing_state()\n")
    tree = ast.parse(code)
    assert numba_kernels(tree) == [("k", 6)]
    assert sorted(torch_privates(tree)) == [("qh…_dequantize_per_tensor_backend", 11), ("torch._dynamo.config", 4),
                                            ("torch…_C", 11), ("torch…_get_tracing_state", 11)]


def private_reaches(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of every private name of another dqsgd module that ``tree`` uses: ``from dqsgd.x
    import _y``, or ``m._y`` where ``m`` was bound by importing a dqsgd module."""
    found: list[tuple[str, int]] = []
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dqsgd"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append((f"{node.module}.{a.name}", node.lineno))
                else:
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            modules.update((a.asname or a.name.split(".")[0]) for a in node.names if a.name.startswith("dqsgd"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append((f"{node.value.id}.{node.attr}", node.lineno))
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    """Layers talk through public names: what one module needs from another is part of its interface."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for name, line in private_reaches(ast.parse(path.read_text(), str(path))):
            bad.append(f"{path.relative_to(SRC.parent)}:{line} uses {name}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_the_private_check_catches_both_forms() -> None:
    tree = ast.parse("from dqsgd.codecs.wire import _x\nfrom dqsgd.codecs import wire\nwire._y(1)\nwire.z()\n")
    assert [n for n, _ in private_reaches(tree)] == ["dqsgd.codecs.wire._x", "wire._y"]


def _private_uses(module: str, tree: ast.Module) -> list[str]:
    """Private modules (``a.b._c``) of another package that ``module`` imports (private names:
    :func:`private_reaches`)."""
    def private(part: str) -> bool:
        return part.startswith("_") and not part.endswith("__")

    is_package = (SRC / module.replace("dqsgd.", "", 1).replace(".", "/")).is_dir()
    home, found = module if is_package else module.rsplit(".", 1)[0], []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("dqsgd"):
            parts = n.module.split(".")
            for i, part in enumerate(parts):
                if private(part) and not (home + ".").startswith(".".join(parts[:i]) + "."):
                    found.append(f"{module}:{n.lineno} imports {n.module}")
    return found


def test_no_private_module_is_used_across_packages() -> None:
    found = [u for m, path in modules()
             for u in _private_uses(m, ast.parse(path.read_text(), str(path)))]
    assert found == []


def test_the_check_catches_a_private_module_of_another_package() -> None:
    tree = ast.parse("from dqsgd.quantizers._common import flat_float\n")
    assert len(_private_uses("dqsgd.kernels.codec", tree)) == 1
    assert _private_uses("dqsgd.quantizers.sign", tree) == []


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle_between_modules() -> None:
    """Every runtime import (function bodies included) is an edge."""
    edges = {m: {t for t, _ in runtime_imports(ast.parse(path.read_text(), str(path))) if t != m}
             for m, path in modules()}
    assert import_cycles(edges) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
