"""A private, bandwidth-shaped network for W ranks: one Linux network namespace per rank.

    ns <prefix>-br :  bridge br0 ── port p0 ── p1 ── p2 ── p3        (tbf on each port: downlink)
                                    │          │     │     │
    ns <prefix>-0  :  eth0 10.99.0.1/24 (tbf: uplink)     ...  ns <prefix>-3: eth0 10.99.0.4/24

Every address exists only inside these namespaces; nothing is routed to or from the host's own
network (the bridge lives in its own namespace, the host namespace gets no address). Needs root and
iproute2 (``ip``, ``tc``). ``tc``: a token bucket (tbf) on both ends of every veth pair, so each rank
has ``rate`` up and ``rate`` down; or, for ranks grouped into nodes (HSDP), ``rate`` only between
nodes and a fast link inside each (:func:`shaping_plan`). Every namespace is deleted by :meth:`PrivateNetwork.close`
(called from ``with``, ``atexit`` and SIGTERM/SIGINT), which also removes the veth pairs.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Callable, Mapping

SUBNET = "10.99.0"


class NetworkUnavailable(RuntimeError):
    """No root, no iproute2, or the kernel refused namespaces/veth/tbf: the benchmark must be skipped."""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise NetworkUnavailable(f"`{' '.join(cmd)}` failed: {p.stderr.strip()}")


def rate_bits(rate: str) -> int:
    """'100mbit' -> 100_000_000 (tc's units: kbit, mbit, gbit)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use a number with kbit, mbit or gbit, e.g. 100mbit")
    return int(float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)])


def _burst(rate: str) -> str:
    """Bytes a bucket of ``rate`` may send at once: >= 2 ms at line rate, and at least a few GSO packets."""
    return str(max(64 * 1024, rate_bits(rate) // 8 // 500))


def _tbf(rate: str) -> list[str]:
    return ["tbf", "rate", rate, "burst", _burst(rate), "latency", "200ms"]


def node_of(rank: int, world: int, nodes: int) -> int:
    """The node of ``rank`` when ``world`` ranks form ``nodes`` nodes of consecutive ranks (HSDP's
    nodes × world/nodes mesh: the shard dimension is the consecutive one)."""
    return rank // (world // nodes)


def shaping_plan(world: int, rate: str, nodes: int = 1, fast: str | None = None) -> list[tuple[int | None, list[str]]]:
    """The tc commands that shape the links, as (the rank whose namespace runs it, or None for the
    bridge's; argv). ``nodes`` = 1: a tbf of ``rate`` as root qdisc of every eth0 (uplink) and bridge
    port p<r> (downlink). ``nodes`` > 1 (ranks grouped as by :func:`node_of`): each of those devices
    gets an htb root with two classes of ``fast`` (default 10gbit): 1:10 for the packets to (on eth0:
    destination) or from (on the port: source) a rank of the same node, chosen by u32 filters, and the
    default 1:20, whose leaf is the tbf of ``rate``. So every rank has ``rate`` up and down to other
    nodes and ``fast`` inside its node. The flat tbf comes first there too: an htb root cannot be
replaced by another, anything can be by a tbf. (This kernel's set of qdiscs may lack prio and pfifo; htb, tbf
    and u32 are what ``dqsgd bench network`` already needs or the commonest.)"""
    rate_bits(rate)
    fast = fast or "10gbit"
    rate_bits(fast)
    if not 1 <= nodes <= world or world % nodes:
        raise ValueError(f"{nodes} nodes do not divide {world} ranks")
    plan: list[tuple[int | None, list[str]]] = []
    for r in range(world):
        for where, dev, field in ((r, "eth0", "dst"), (None, f"p{r}", "src")):
            tc = ["tc", "qdisc", "replace", "dev", dev]
            plan.append((where, tc + ["root", *_tbf(rate)]))
            if nodes == 1:
                continue
            plan.append((where, tc + ["root", "handle", "1:", "htb", "default", "20"]))
            for cls in ("1:10", "1:20"):
                plan.append((where, ["tc", "class", "replace", "dev", dev, "parent", "1:", "classid", cls, "htb",
                                     "rate", fast, "ceil", fast, "burst", _burst(fast), "cburst", _burst(fast),
                                     "quantum", "65536"]))
            plan.append((where, tc + ["parent", "1:20", "handle", "20:", *_tbf(rate)]))
            for peer in range(world):
                if peer != r and node_of(peer, world, nodes) == node_of(r, world, nodes):
                    plan.append((where, ["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                                         "prio", "1", "u32", "match", "ip", field, f"{SUBNET}.{peer + 1}/32",
                                         "flowid", "1:10"]))
    return plan


def check_available() -> None:
    if os.geteuid() != 0:
        raise NetworkUnavailable("needs root (network namespaces and tc)")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise NetworkUnavailable(f"needs iproute2 ({', '.join(missing)} not found): apt-get install -y iproute2")


class PrivateNetwork:
    """``world`` namespaces joined by a bridge; :meth:`shape` sets the link rate; :meth:`exec_prefix` runs in one."""

    def __init__(self, world: int, prefix: str | None = None):
        check_available()
        if not 1 <= world <= 200:
            raise ValueError(f"world must be in [1, 200], got {world}")
        self.world = world
        self.prefix = prefix or f"dqsgd-bn{os.getpid()}"
        self.bridge_ns = f"{self.prefix}-br"
        self.created: list[str] = []
        self._old_handlers: dict[int, object] = {}
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, rank: int) -> str:
        return f"{self.prefix}-{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def _netns_add(self, name: str) -> None:
        _ip("ip", "netns", "add", name)
        self.created.append(name)
        _ip("ip", "link", "set", "lo", "up", ns=name)

    def _build(self) -> None:
        self._netns_add(self.bridge_ns)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _ip("ip", "link", "set", "br0", "up", ns=self.bridge_ns)
        for r in range(self.world):
            ns, port = self.ns(r), f"p{r}"
            self._netns_add(ns)
            # Create the pair inside the bridge namespace, then move one end: the host never holds it.
            _ip("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns, ns=self.bridge_ns)
            _ip("ip", "link", "set", port, "master", "br0", ns=self.bridge_ns)
            _ip("ip", "link", "set", port, "up", ns=self.bridge_ns)
            _ip("ip", "addr", "add", f"{self.address(r)}/24", "dev", "eth0", ns=ns)
            _ip("ip", "link", "set", "eth0", "up", ns=ns)

    def shape(self, rate: str, nodes: int = 1, fast: str | None = None) -> None:
        """``rate`` each way on every rank's link: tbf on eth0 (uplink) and on its bridge port (downlink).
        With ``nodes`` > 1 the ranks form nodes of world/nodes consecutive ranks and only the traffic
        between nodes gets ``rate``; inside a node it is unshaped, or ``fast`` (:func:`shaping_plan`)."""
        for where, cmd in shaping_plan(self.world, rate, nodes, fast):
            _ip(*cmd, ns=self.bridge_ns if where is None else self.ns(where))

    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(rank)]

    def close(self) -> None:
        while self.created:
            name = self.created.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def __enter__(self) -> PrivateNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(net: PrivateNetwork, argv: Callable[[int], list[str]], env: Mapping[str, str], timeout: float,
              what: str) -> None:
    """Run ``argv(r)`` for every rank r in its namespace (each in its own session) and wait; kill the
    whole run past ``timeout`` seconds or as soon as one rank fails (RuntimeError naming ``what``)."""
    procs = []
    try:
        for r in range(net.world):
            procs.append(subprocess.Popen(net.exec_prefix(r) + argv(r), env=dict(env), start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        time.sleep(0.5)
        codes = [p.poll() for p in procs]
        if codes != [0] * len(procs):
            raise RuntimeError(f"{what}: ranks ended with {codes} (None: still running at the deadline)")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # each rank was started in its own session
                p.wait(timeout=10)


def tx_bytes(interface: str = "eth0") -> int:
    """Bytes this namespace's ``interface`` has sent (``ip netns exec`` mounts the namespace's sysfs)."""
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
        return int(f.read())



def cross_node_bytes(interface: str = "eth0") -> int:
    """Bytes this namespace's ``interface`` has sent to other nodes: the tbf leaf 20: that
    :func:`shaping_plan` gives the inter-node class when the ranks form nodes."""
    p = subprocess.run(["tc", "-s", "qdisc", "show", "dev", interface, "parent", "1:20"], capture_output=True,
                       text=True, timeout=30)
    m = re.search(r"Sent (\d+) bytes", p.stdout)
    if p.returncode != 0 or m is None:
        raise NetworkUnavailable(f"no inter-node class on {interface}: {p.stderr.strip() or p.stdout.strip()}")
    return int(m.group(1))
