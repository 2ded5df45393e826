"""benchmarks/network/netns.py's tc plan for `dqsgd bench fsdp --rates --nodes N`, without root: which
rules each namespace gets, read back as the rate every ordered pair of ranks is shaped to."""

from __future__ import annotations

from typing import Any

import pytest

from dqsgd.cli.bench import parser as bench_cli


@pytest.fixture(scope="module")
def netns() -> Any:
    module = bench_cli.load_script("network/netns.py")
    assert module is not None
    return module


def _path_rates(plan: list[tuple[int | None, list[str]]], world: int,
                subnet: str = "10.99.0") -> dict[tuple[int, int], tuple[str, str]]:
    """For every ordered pair (i, j): the rate of the bucket i's packets to j pass on i's eth0 (uplink)
    and on j's bridge port (downlink), read from the plan as tc would apply it (the last root qdisc
    of a device wins; its filters choose a class by address, else the default class; a class's
    rate is its leaf tbf's, else its own)."""
    devs: dict[tuple[int | None, str], dict[str, Any]] = {}
    for where, cmd in plan:
        dev = devs.setdefault((where, cmd[cmd.index("dev") + 1]), {})
        if cmd[:3] == ["tc", "qdisc", "replace"] and "root" in cmd:
            dev.clear()
            dev["root"] = cmd[cmd.index("root") + 1:]
            dev["filters"], dev["rates"] = [], {}
        elif cmd[:3] == ["tc", "class", "replace"]:
            dev["rates"].setdefault(cmd[cmd.index("classid") + 1], cmd[cmd.index("rate") + 1])
        elif cmd[:3] == ["tc", "qdisc", "replace"]:  # a leaf: its rate is the class's
            dev["rates"][cmd[cmd.index("parent") + 1]] = cmd[cmd.index("rate") + 1]
        else:
            assert cmd[:3] == ["tc", "filter", "add"] and cmd[cmd.index("match") + 1] == "ip", cmd
            i = cmd.index("match")
            dev["filters"].append((cmd[i + 2], cmd[i + 3], cmd[cmd.index("flowid") + 1]))

    def rate(dev: dict[str, Any], field: str, addr: str) -> str:
        if dev["root"][0] == "tbf":
            return dev["root"][dev["root"].index("rate") + 1]
        assert dev["root"][:3] == ["handle", "1:", "htb"] and dev["root"][3] == "default"
        cls = next((c for f, a, c in dev["filters"] if f == field and a == f"{addr}/32"), "1:" + dev["root"][4])
        return dev["rates"][cls]

    addr = [f"{subnet}.{r + 1}" for r in range(world)]
    return {(i, j): (rate(devs[(i, "eth0")], "dst", addr[j]), rate(devs[(None, f"p{j}")], "src", addr[i]))
            for i in range(world) for j in range(world) if i != j}


@pytest.mark.parametrize("world,nodes", [(4, 2), (6, 3), (6, 2), (8, 4), (4, 4)])
def test_links_inside_a_node_are_fast_and_between_nodes_shaped(netns: Any, world: int, nodes: int) -> None:
    rates = _path_rates(netns.shaping_plan(world, "100mbit", nodes, "10gbit"), world)
    size = world // nodes
    for (i, j), got in rates.items():
        assert got == (("10gbit",) * 2 if i // size == j // size else ("100mbit",) * 2), (i, j)
    assert sum(got == ("10gbit", "10gbit") for got in rates.values()) == world * (size - 1)


def test_one_node_is_the_flat_plan_of_bench_network(netns: Any) -> None:
    tbf = ["root", "tbf", "rate", "100mbit", "burst", "65536", "latency", "200ms"]
    want = [(0, ["tc", "qdisc", "replace", "dev", "eth0", *tbf]), (None, ["tc", "qdisc", "replace", "dev", "p0", *tbf]),
            (1, ["tc", "qdisc", "replace", "dev", "eth0", *tbf]), (None, ["tc", "qdisc", "replace", "dev", "p1", *tbf])]
    assert netns.shaping_plan(2, "100mbit") == want
    assert set(_path_rates(netns.shaping_plan(3, "1gbit", 1, "10gbit"), 3).values()) == {("1gbit", "1gbit")}


def test_the_default_rate_inside_a_node_is_10gbit(netns: Any) -> None:
    assert _path_rates(netns.shaping_plan(4, "1gbit", 2), 4)[(0, 1)] == ("10gbit", "10gbit")


@pytest.mark.parametrize("world,nodes,rate,fast,err", [
    (4, 3, "100mbit", None, "3 nodes do not divide 4 ranks"), (4, 0, "100mbit", None, "0 nodes"),
    (4, 2, "fast", None, "rate 'fast'"), (4, 2, "1gbit", "10G", "rate '10G'")])
def test_bad_plans_are_refused(netns: Any, world: int, nodes: int, rate: str, fast: str | None, err: str) -> None:
    with pytest.raises(ValueError, match=err):
        netns.shaping_plan(world, rate, nodes, fast)


def test_bench_fsdp_refuses_a_bad_node_rate_before_any_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    from dqsgd.cli import main

    code = main(["bench", "fsdp", "--world", "4", "--nodes", "2", "--rates", "100mbit", "--node-rate", "10G",
                 "--out", ""])
    assert code != 0 and "rate '10G'" in capsys.readouterr().err
