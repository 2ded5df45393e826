"""State of the FSDP2 gradient compressor: one :class:`FSDPState` per model, one
:class:`~dqsgd.topology.state.BucketState` per FSDP unit.

A unit is one ``fully_shard``-ed module; FSDP calls its reduce-scatter once per backward with a
flat gradient of W·n elements (W the shard group's size, n the unit's padded shard). The unit is
the exchange's bucket: its own :class:`~dqsgd.method.pipeline.Method` and policy (one width per step for
the whole unit), this rank's error-feedback residuals and generator, its step counter and its seed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from dqsgd.core.comm_stats import CompressionStats
from dqsgd.core.rng import QUANT, seed_for
from dqsgd.core.ranges import check_count, check_rate, check_seed, check_timeout
from dqsgd.core.timeouts import HOOK_COLLECTIVE_S
from dqsgd.method.config import MethodConfig, check_fed_policy, check_one_message, method_config

if TYPE_CHECKING:
    from dqsgd.topology.state import BucketState

STATE_VERSION = 1
_COUNTERS = ("bytes_sent", "bytes_received", "exact_bytes", "side_bytes", "fp32_bytes", "bit_coords", "coords",
             "calls", "dense_bytes", "refusals")


def unit_seed(seed: int, unit: int, replica: int = 0) -> int:
    """The seed of unit ``unit``'s sharded protocol (its quantization keys derive from it); under HSDP
    each replica (node) ``replica`` > 0 draws its own, so the nodes' roundings are independent."""
    return seed_for(seed, QUANT, unit) if replica == 0 else seed_for(seed, QUANT, unit, replica)


def unit_state_dict(b: BucketState, calls: int) -> dict[str, Any]:
    """Unit ``b``'s state (its policy fed every step it took first): the policy, the step, the
    generator and the error-feedback residual of the whole flat gradient."""
    from dqsgd.policies import state_to_dict

    b.catch_up(b.step)
    res = [b.residuals.get(j) for j in range(len(b.bounds))]
    return {"numel": b.numel, "world": b.proto.workers, "pieces": b.sizes, "n": b.step, "calls": calls,
            "policy": state_to_dict(b.policy), "generator": b.generator.get_state(),  # type: ignore[union-attr]
            "residual": torch.cat(res).clone() if all(r is not None for r in res) else None}


def load_unit(b: BucketState, d: dict[str, Any], unit: int) -> None:
    """Restore :func:`unit_state_dict` into ``b`` (the same model, sharding and world size)."""
    from dqsgd.policies import state_from_dict

    for key, mine in (("numel", b.numel), ("world", b.proto.workers), ("pieces", b.sizes)):
        got = tuple(d[key]) if key == "pieces" else d[key]
        if got != mine:
            raise ValueError(f"FSDP unit {unit}: the checkpoint's {key} is {d[key]}, this model's {mine} (same "
                             "model, same sharding and world size needed)")
    if d["residual"] is not None and d["residual"].numel() != b.numel:
        raise ValueError(f"FSDP unit {unit}: the checkpoint's residual holds {d['residual'].numel()} elements, the "
                         f"unit {b.numel}")
    b.policy = state_from_dict(type(b.policy), d["policy"])
    b.step = int(d["n"])
    b.generator.set_state(d["generator"])  # type: ignore[union-attr]
    r = d["residual"]
    b.residuals = {} if r is None else {j: r[lo:hi].clone() for j, (lo, hi) in enumerate(b.bounds)}


class FSDPState:
    """Configuration and state of :func:`dqsgd.fsdp.compress` for one model (like the DDP hook's
    ``HookState``): the method, seed, horizon, manners and every unit's state.

    ``method``: a registered name (``"qsgd-4bit"``, ``"dqsgd"``, ``"dqsgd-coded"``, ``"ef-signsgd"``,
    ``"terngrad"``, ``"sgd"``, …) or a :class:`~dqsgd.method.config.MethodConfig`; ``seed`` of the quantization
    randomness; ``total_steps``: the horizon N of dynamic policies (a budget is spread over N steps of
    each unit); ``timeout``: seconds any collective may take; ``start_iter``: backward passes sent as
    FSDP's exact reduce-scatter first (PowerSGD's ``start_powerSGD_iter``); ``min_numel``: a unit with
    fewer gradient elements (W·n) is reduced exactly; ``min_compression_rate``: a unit whose predicted
    ratio (bytes in the reduce dtype / payload bytes) is below this is reduced exactly.

    The parameter all-gather (:mod:`dqsgd.fsdp.gather`): ``param_bits`` None (FSDP's own, exact),
    8 or 4 (block-wise max-norm quantization, ``param_block`` coordinates per scale) or 32 (float32
    through dqsgd, lossless); ``param_rounding`` ``"nearest"`` or ``"stochastic"`` (seeded from the
    seed, the unit, the rank and the call).
    """

    def __init__(self, method: str | MethodConfig = "dqsgd", seed: int = 0, total_steps: int = 1000, *,
                 timeout: float | None = HOOK_COLLECTIVE_S, start_iter: int = 0, min_numel: int = 0,
                 min_compression_rate: float = 1.0, param_bits: int | None = None,
                 param_rounding: str = "nearest", param_block: int = 2048):

        if isinstance(method, str):
            method = method_config(method)  # raises ValueError naming the registered methods
        if not isinstance(method, MethodConfig):
            raise TypeError("method must be a method name or a dqsgd.method.config.MethodConfig, "
                            f"got {type(method).__name__}")
        check_method(method)
        check_seed("seed", seed)
        for name, value, low in (("total_steps", total_steps, 1), ("start_iter", start_iter, 0),
                                 ("min_numel", min_numel, 0)):
            check_count(name, value, low)
        check_timeout("timeout", timeout)
        check_rate("min_compression_rate", min_compression_rate)
        check_param_options(param_bits, param_rounding, param_block)
        self.param_bits, self.param_rounding, self.param_block = param_bits, param_rounding, param_block
        self.param_sent = self.param_side = self.param_fp32 = self.param_calls = 0
        self.gather_calls: dict[int, int] = {}  # unit -> its parameter all-gathers so far (the rounding keys)
        self.config, self.seed, self.total_steps, self.timeout = method, seed, total_steps, timeout
        self.start_iter, self.min_numel, self.min_compression_rate = start_iter, min_numel, float(min_compression_rate)
        self.units: dict[int, BucketState] = {}  # every unit's one state holder (this rank's memory in it)
        self.unit_calls: dict[int, int] = {}  # unit -> its reduce-scatters so far (warm-up included)
        self.replica = 0  # HSDP: this rank's index in its replica group (compress(replicate=...) sets it)
        self.seconds = 0.0  # wall time spent inside the reduce-scatter calls (encode, exchange, decode)
        self._loaded: dict[int, dict[str, Any]] = {}
        for name in _COUNTERS:
            setattr(self, name, 0)

    def fields(self) -> dict[str, Any]:
        """Everything the ranks must share, by name (compared at each unit's first reduce-scatter with
        :func:`dqsgd.topology.agreement.agree`): the method and every option, the seed, the horizon,
        the manners, the state format and the dqsgd version."""
        import dataclasses

        from dqsgd import __version__

        out: dict[str, Any] = {f"method.{k}": v for k, v in dataclasses.asdict(self.config).items()}
        out.update({"seed": self.seed, "total_steps": self.total_steps, "start_iter": self.start_iter,
                    "min_numel": self.min_numel, "min_compression_rate": self.min_compression_rate,
                    "param_bits": self.param_bits, "param_rounding": self.param_rounding,
                    "param_block": self.param_block,
                    "state_version": STATE_VERSION, "dqsgd_version": __version__})
        return out

    # --- units ----------------------------------------------------------------------------------
    def unit(self, index: int, numel: int, world: int, rank: int, pieces: tuple[int, ...]) -> BucketState:
        """Unit ``index``'s state, built on first use (then restored from a loaded state_dict)."""
        u = self.units.get(index)
        if u is not None:
            if (u.numel, u.proto.workers) != (numel, world):
                raise ValueError(f"FSDP unit {index}: reduce-scatter of {numel} elements over {world} ranks, "
                                 f"earlier {u.numel} over {u.proto.workers}")
            return u
        from dqsgd.fsdp.unit import unit_protocol
        from dqsgd.topology.bucket import worker_generator
        from dqsgd.topology.state import BucketState

        seed = unit_seed(self.seed, index, self.replica)
        proto = unit_protocol(self.config, numel, self.total_steps, list(pieces), world, seed)
        u = BucketState(numel=numel, proto=proto, policy=proto.policy.init(), sizes=tuple(pieces),
                        generator=worker_generator(seed, rank))
        self.units[index] = u
        if index in self._loaded:
            d = self._loaded.pop(index)
            load_unit(u, d, index)
            self.unit_calls[index] = int(d["calls"])
        return u

    def count(self, sent: int, received: int, side: int, numel: int, world: int, width: int, exact: int = 0,
              itemsize: int = 4, refused: bool = False) -> None:
        """One reduce-scatter's bytes as this rank handed them to the process group (``exact``: the bytes
        of FSDP's own reduce-scatter when ``refused`` to compress); ``fp32_bytes`` grows by what an fp32 reduce-scatter
        of the same gradient sends per rank, (W−1)/W·4·numel, ``dense_bytes`` by what one in the
        gradient's dtype sends and receives."""
        self.bytes_sent += sent
        self.bytes_received += received
        self.side_bytes += side
        self.exact_bytes += exact
        self.refusals += int(refused)
        self.fp32_bytes += (world - 1) * 4 * numel // world
        self.dense_bytes += 2 * ((world - 1) * itemsize * numel // world)
        self.bit_coords += width * numel
        self.coords += numel
        self.calls += 1

    def count_params(self, sent: int, side: int, fp32: int) -> None:
        """One parameter all-gather: the payload bytes this rank handed to the group, its frames' headers,
        and what FSDP's fp32 all-gather sends per rank, (W−1)·4·n."""
        self.param_sent += sent
        self.param_side += side
        self.param_fp32 += fp32
        self.param_calls += 1

    def compression_stats(self) -> CompressionStats:
        """This rank's traffic since the state was made (docs/api.md, "Statistics"): the reduce-scatter is
        the uplink; the parameter all-gather, when dqsgd quantizes it (``param_bits``), the downlink (else
        FSDP's own, not counted); a round is a backward pass."""
        both = self.side_bytes + self.exact_bytes  # symmetric: what it sends, it receives
        down = self.param_sent + self.param_side  # an all-gather: it receives as much as it sends
        steps = max([*self.unit_calls.values()] + [int(d["calls"]) for d in self._loaded.values()], default=0)
        return CompressionStats(uplink_sent=self.bytes_sent + both, uplink_received=self.bytes_received + both,
                                downlink_sent=down, downlink_received=down, fp32_bytes=4 * self.coords,
                                dense_bytes=self.dense_bytes + 2 * self.param_fp32,
                                mean_bits=self.bit_coords / self.coords if self.coords else math.nan,
                                steps=steps, rounds=steps, refusals=self.refusals)

    def __repr__(self) -> str:
        return (f"<FSDPState method={self.config.name!r} ({self.config.budget_text()}), topology=reduce-scatter "
                f"(compressed all-to-all), units={len(self.units)}, total_steps={self.total_steps}, "
                f"steps={self.compression_stats().steps}>")

    def stats(self) -> dict[str, float]:
        """Deprecated: :meth:`compression_stats`. Bytes this rank sent (compressed payloads, side traffic,
        exact reduce-scatters), the fp32 reduce-scatter's bytes for the same calls ((W−1)/W·4·numel), and
        their ratio; the parameter all-gathers' bytes (``param_*``) and FSDP's fp32 all-gather's."""
        import warnings

        warnings.warn("FSDPState.stats() is deprecated: use compression_stats(), the DDP hook's and Local SGD's "
                      "statistics object (docs/api.md)", DeprecationWarning, stacklevel=2)
        sent = self.bytes_sent + self.side_bytes + self.exact_bytes
        return {"bytes_sent": self.bytes_sent, "side_bytes": self.side_bytes, "exact_bytes": self.exact_bytes,
                "total_sent": sent, "bytes_received": self.bytes_received, "fp32_rs_bytes": self.fp32_bytes,
                "ratio": self.fp32_bytes / sent if sent else math.nan, "calls": self.calls,
                "mean_bits": self.bit_coords / self.coords if self.coords else math.nan, "seconds": self.seconds,
                "param_bytes_sent": self.param_sent, "param_side_bytes": self.param_side,
                "fp32_ag_bytes": self.param_fp32, "param_calls": self.param_calls}

    # --- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed job needs to continue bitwise: per-unit policy states (the budget's
        ledger), residuals, generators and step counters; the traffic counters."""
        units = {i: unit_state_dict(u, self.unit_calls.get(i, 0)) for i, u in self.units.items()}
        return {"version": STATE_VERSION, "method": self.config.name, "seed": self.seed, "fields": self.fields(),
                "counters": {k: getattr(self, k) for k in _COUNTERS}, "units": {**self._loaded, **units},
                "gather_calls": dict(self.gather_calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a unit's state applies at its next reduce-scatter."""
        from dqsgd.topology.agreement import check_state, refuse_changed

        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a dqsgd FSDPState state_dict (version {STATE_VERSION})")
        check_state(state, {"method": str, "seed": int, "counters": dict, "units": dict}, "FSDPState state_dict")
        check_state(state["counters"], dict.fromkeys(_COUNTERS, int), "FSDPState state_dict counters")
        for i, u in state["units"].items():
            check_state(u, UNIT_KEYS, f"FSDPState state_dict unit {i}")
        gathers = state.get("gather_calls", {})  # older states: the all-gathers start again at 0
        if not isinstance(gathers, dict) or not all(type(k) is int and k >= 0 and type(v) is int and v >= 0
                                                    for k, v in gathers.items()):
            raise ValueError("FSDPState state_dict gather_calls: a dict of unit index -> count (ints >= 0)")
        # states saved before the full configuration was recorded: their method's name and seed
        saved = state.get("fields", {"method.name": state["method"], "seed": state["seed"]})
        refuse_changed("FSDPState state_dict", saved, self.fields(), _stateful)
        for k in _COUNTERS:
            setattr(self, k, state["counters"].get(k, 0))  # older states: no dense bytes, no refusals
        self.units, self.unit_calls, self._loaded = {}, {}, dict(state["units"])
        self.gather_calls = dict(gathers)


UNIT_KEYS = {"numel": int, "world": int, "pieces": (tuple, list), "n": int, "calls": int, "policy": (dict, None),
             "generator": torch.Tensor, "residual": (torch.Tensor, None)}


def _stateful(key: str) -> bool:
    """What a unit's saved state depends on: the method and every option, the horizon and the seed (the
    units' quantization keys); warm-up, min_numel and the ratio threshold may change on resume."""
    return key.startswith("method.") or key in ("total_steps", "seed")


PARAM_BITS = (None, 4, 8, 32)
ROUNDINGS = ("nearest", "stochastic")


def check_param_options(bits: int | None, rounding: str, block: int) -> None:
    if bits not in PARAM_BITS or isinstance(bits, bool):
        raise ValueError(f"param_bits must be one of {PARAM_BITS} (None: FSDP's own all-gather; 32: float32 "
                         f"through dqsgd, lossless), got {bits!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"param_rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 1 << 20:
        raise ValueError(f"param_block must be an int in [1, 2^20] (coordinates per scale), got {block!r}")


def check_method(cfg: MethodConfig) -> None:
    """Refuse what a reduce-scatter cannot be: a sign vote (not a sum), a policy needing the whole
    averaged gradient (FSDP never assembles it), a method sent in two rounds (Sketched SGD)."""
    check_one_message(cfg, "FSDP's reduce-scatter")
    check_fed_policy(cfg, "FSDP's reduce-scatter")
    if cfg.aggregate == "majority":
        raise ValueError(f"method {cfg.name!r}: a majority vote is not a sum, so it cannot stand for FSDP's "
                         "reduce-scatter; use ef-signsgd (error-fed scaled signs, averaged)")
    if cfg.policy in ("adaqs",):
        raise ValueError(f"method {cfg.name!r}: policy {cfg.policy!r} keeps statistics of every coordinate of the "
                         "averaged gradient, which no FSDP rank holds; supported: fixed widths, dqsgd, dqsgd-coded, "
                         "the dqsgd rules and adaptive")
