"""The package's layers are its folders: a module may import its own folder or a lower one.

Two more rules keep the package to its public ground: numba kernels are defined only in the codecs and
kernels, and no module reaches a private name of torch beyond the one listed use (the benchmarks that
compare against PyTorch's private quantization backend, or time the fused kernel's pieces with a kernel
of their own, live in ``benchmarks/``, outside the package). And the shape of the package: no import
cycle between modules or between folders, no private module or name used across packages, no module
over :data:`MAX_LINES` lines.

Every import counts, ``if TYPE_CHECKING:`` blocks and function bodies included: an annotation that
names an upper layer is a dependency on it. ``from dqsgd.pkg import mod`` of a module is an import of
that module (a package's ``__init__`` of lazy exports is not then a step of a cycle).

Read bottom to top, one training step goes trainer → topology (its step objects over the links'
interface) → method (quantizer registry, codec) → policy; the transports implement the links.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dqsgd

SRC = Path(dqsgd.__file__).parent
ROOT = "dqsgd"  # the modules at the top of src/dqsgd: the public face (api.py, local.py, __main__.py)
LAYERS: list[list[str]] = [  # the folders of src/dqsgd, lowest first
    ["core"],
    ["quantizers", "data", "models"],
    ["codecs", "theory"],                 # theory: the paper's bounds (the policies read them) and their checks
    ["kernels"],
    ["policies"],
    ["method"],
    ["topology"],                         # the per-bucket protocol, the step objects, the links they run over
    ["transport"],                        # the links: in-process, torch.distributed
    ["train", "ddp", "fsdp", "dq"],
    ["experiments", "cli"],
    [ROOT],
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
    [f"{BENCH}.gpu_step"],
    [f"{BENCH}.gpu"],
    [f"{BENCH}.gpu_parser"],
    [f"{BENCH}.parser"],
]
MAX_LINES = 450


def folder_of(module: str) -> str:
    """The folder directly under src/dqsgd that holds ``module`` (:data:`ROOT` for the top modules)."""
    parts = module.split(".")
    if len(parts) > 1 and (SRC / parts[1]).is_dir():
        return parts[1]
    return ROOT


def layer_of(module: str, layers: list[list[str]] = LAYERS) -> int | None:
    """``module``'s layer: its folder's (:data:`LAYERS`), or in a finer table the longest listed prefix."""
    if layers is LAYERS:
        folder = folder_of(module)
        return next((i for i, names in enumerate(LAYERS) if folder in names), None)
    best: tuple[int, int] | None = None
    for i, names in enumerate(layers):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > best[1]):
                best = (i, len(n))
    return None if best is None else best[0]


def is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(module, line) of every ``dqsgd`` import: module level, function bodies and ``if TYPE_CHECKING:``
    blocks alike; ``from P import m`` of a module ``P.m`` is an import of ``P.m``."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "dqsgd" or node.module.startswith("dqsgd."):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if is_module(sub):
                        found.append((sub, node.lineno))
                    elif node.module != "dqsgd" or a.name != "__version__":
                        found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.startswith("dqsgd."))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("dqsgd."):
                found.append((arg.value, node.lineno))
    return sorted(set(found), key=lambda f: (f[1], f[0]))


def modules() -> list[tuple[str, Path]]:
    out = []
    for f in sorted(SRC.rglob("*.py")):
        parts = ("dqsgd", *f.relative_to(SRC).with_suffix("").parts)
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), f))
    return out


def edges() -> dict[str, set[str]]:
    return {m: {t for t, _ in imports(ast.parse(path.read_text(), str(path))) if t != m} for m, path in modules()}


def test_every_folder_has_a_layer() -> None:
    folders = sorted({folder_of(m) for m, _ in modules()})
    assert [f for f in folders if layer_of(f"dqsgd.{f}") is None] == []
    assert sorted(f for names in LAYERS for f in names) == folders  # no layer names a folder that is gone


def upward_imports(layers: list[list[str]]) -> list[str]:
    up = []
    for module, path in modules():
        me = layer_of(module, layers)
        for target, line in imports(ast.parse(path.read_text(), str(path))):
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
    tree = ast.parse("from dqsgd.train.runner import run_one\nif TYPE_CHECKING:\n    from dqsgd.cli import main\n"
                     "from dqsgd.kernels import fused, HashRNG\n")
    assert imports(tree) == [("dqsgd.train.runner", 1), ("dqsgd.cli", 3), ("dqsgd.kernels", 4),
                             ("dqsgd.kernels.fused", 4)]
    assert layer_of("dqsgd.train.runner") > layer_of("dqsgd.transport.base") > layer_of("dqsgd.topology.step")
    assert layer_of("dqsgd.local") == layer_of("dqsgd") == len(LAYERS) - 1


KERNEL_HOMES = ("dqsgd.codecs", "dqsgd.kernels")
TORCH_PRIVATES_USED = {  # module: the private torch names it reaches, each guarded where it is used
    # the rendezvous store of the default group, read for peers' error reports (best effort: None on failure)
    "dqsgd.transport.torch_dist": ["dist…_get_default_store"],
    # FSDP2's ReduceScatter interface class (torch exports no public name for it; absent: compress() says so)
    "dqsgd.fsdp.comm": ["torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter"],
    # and its AllGather interface class (the quantized parameter all-gather), guarded the same way
    "dqsgd.fsdp.gather": ["torch.distributed.fsdp._fully_shard._fsdp_api.AllGather"],
    # the autograd engine's end-of-backward callback: the hook raises a bucket's error there, with its type;
    # and the running backward's id (getattr-guarded), so a backward that raised leaves no stale callback
    "dqsgd.ddp.comm_hook": ["torch…_C", "torch…_execution_engine"],
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
    """Every import is an edge (function bodies and ``if TYPE_CHECKING:`` blocks included)."""
    assert import_cycles(edges()) == []


def test_no_import_cycle_between_folders() -> None:
    folders: dict[str, set[str]] = {}
    for m, targets in edges().items():
        folders.setdefault(folder_of(m), set()).update(folder_of(t) for t in targets if folder_of(t) != folder_of(m))
    assert import_cycles(folders) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
