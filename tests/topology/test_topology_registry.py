"""The topologies as objects (dqsgd.topology.registry): what each says, and that nobody else asks by name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dqsgd
from dqsgd.topology import registry
from dqsgd.topology.registry import ALLGATHER, PS, REGISTRY, SHARDED, Topology, topology_of

SRC = Path(dqsgd.__file__).parent
NAMES = "|".join(map(re.escape, REGISTRY))
LITERAL = rf"""["'](?:{NAMES})["']"""
COMPARISONS = [  # a name compared as a string: x == "ps", "sharded" != x, x in ("ps", ...), case "ps"
    re.compile(rf"(?:==|!=)\s*{LITERAL}"), re.compile(rf"{LITERAL}\s*(?:==|!=)"),
    re.compile(rf"\bin\s*[(\[{{][^)\]}}]*{LITERAL}"), re.compile(rf"\bcase\s+{LITERAL}"),
]


def name_comparisons(text: str) -> list[int]:
    return [i for i, line in enumerate(text.splitlines(), 1) if any(p.search(line) for p in COMPARISONS)]


def name_literals(text: str) -> list[int]:
    """Lines where a topology's name is written as a bare string (a default: ``x or "ps"``, ``topology:
    str = "sharded"``, ``f(..., "ps")``, ``{x or 'ps'}`` in an f-string). A name inside a longer string (a
    docstring, a message) is not one; nor is a class saying which topology it runs (``topology = "ps"``)."""
    tree = ast.parse(text)
    says = {id(node.value) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for node in cls.body
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["topology"]}
    return sorted({node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant)
                   and isinstance(node.value, str) and node.value in REGISTRY and id(node) not in says})


def outside_the_registry(find) -> list[str]:
    home = Path(registry.__file__)
    return [f"{path.relative_to(SRC.parent)}:{line}" for path in sorted(SRC.rglob("*.py")) if path != home
            for line in find(path.read_text())]


def test_no_topology_name_is_compared_as_a_string_outside_the_registry() -> None:
    assert outside_the_registry(name_comparisons) == []


def test_no_topology_name_is_written_as_a_default_outside_the_registry() -> None:
    """A run's topology comes from the registry (run_topology, SIMULATED_DEFAULT, PROCESSES_DEFAULT, the
    topology objects), not from a name literal repeated where a default is needed."""
    assert outside_the_registry(name_literals) == []


def test_the_grep_finds_every_form_of_default() -> None:
    code = ('t = cfg.topology or "ps"\ndef f(topology: str = "sharded"):\n    """Topology ``"ps"`` by default."""\n'
            'x = getattr(t, "topology", "ps")\nmake("sharded", g)\nmsg = f"topology {t or \'ps\'} here"\n'
            'err = "use topology \'ps\' here"\nclass T:\n    topology = "allgather"\nd = {"train.topology": "ps"}\n'
            'y = "allgather" if a else b\nz = SHARDED.name\n')
    assert name_literals(code) == [1, 2, 4, 5, 6, 10, 11]


def test_the_grep_finds_every_form_of_comparison() -> None:
    code = ('if topology == "sharded":\n    pass\nif "ps" != t:\n    pass\nok = t in ("ps", "allgather")\n'
            "x = t not in ['sharded']\nmatch t:\n    case 'ps':\n        pass\n"
            'ok = t in HOOK_TOPOLOGIES\nname = "sharded"\nt = topology_of(name).sharded\n')
    assert name_comparisons(code) == [1, 3, 5, 6, 8]


def test_each_topology_says_what_it_does() -> None:
    assert [t.name for t in REGISTRY.values()] == ["ps", "allgather", "sharded"]
    assert (PS.shards(4), ALLGATHER.shards(4), SHARDED.shards(4)) == (1, 1, 4)
    assert [t.server for t in (PS, ALLGATHER, SHARDED)] == [True, False, False]
    assert [t.fp32_legs() for t in (PS, ALLGATHER, SHARDED)] == [2, 1, 2]
    assert registry.HOOK_TOPOLOGIES == ("allgather", "sharded")
    assert all(t.collectives for t in REGISTRY.values())
    assert topology_of("sharded") is SHARDED and topology_of(SHARDED) is SHARDED and str(SHARDED) == "sharded"
    with pytest.raises(ValueError, match="unknown topology 'ring': use one of ps, allgather, sharded"):
        topology_of("ring")
    with pytest.raises(ValueError, match="unknown topology 'ps': use one of allgather, sharded"):
        topology_of("ps", registry.HOOK_TOPOLOGIES)
    with pytest.raises(ValueError, match="the hook's traffic is counted for allgather, sharded, not 'ps'"):
        PS.rank_traffic([[1]], [1], 0)


def test_a_topology_without_a_traffic_formula_cannot_be_made() -> None:
    class Ring(Topology):
        name = "ring"

    with pytest.raises(TypeError, match="abstract"):
        Ring()  # type: ignore[abstract]


def test_hook_traffic_is_the_wire_traffic_of_the_same_messages() -> None:
    """The hook's per-rank count and the trainer's per-phase count of one sharded step agree on what one
    rank receives: the all-to-all's payloads for its shard plus W−1 padded downlinks."""
    table, down = [[3, 5, 7], [4, 6, 8], [9, 2, 1]], [10, 11, 12]
    for rank in range(3):
        sent, recv = SHARDED.rank_traffic(table, down, rank)
        up, dl = SHARDED.wire_traffic(table, down)
        assert max(sent, recv) - dl[rank] == up[rank]


def test_a_topology_registered_later_is_accepted_by_the_config_and_the_cli(monkeypatch) -> None:
    """Adding a topology is one class and one registry line: the config keys and `--topology` read the
    registry itself, not a tuple of names fixed at import."""
    from dqsgd.cli.commands import parser
    from dqsgd.topology.registry import REGISTRY, Sharded
    from dqsgd.train.config import TrainConfig

    class Later(Sharded):
        name = "later-test"

    monkeypatch.setitem(REGISTRY, Later.name, Later())
    assert TrainConfig(topology="later-test").topology == "later-test"
    assert parser().parse_args(["train", "--topology", "later-test"]).topology == "later-test"
    with pytest.raises(ValueError, match="topology must be one of ps, allgather, sharded, later-test"):
        TrainConfig(topology="nope")
