"""The communication ledger: bytes that really crossed the wire, step by step.

Every number here comes from ``len(payload)`` of a real message (never from a dtype or a formula),
next to the nominal bits per coordinate the method intended. Two compression ratios are reported,
and every report says which one it prints:

* measured ratio  = uncompressed fp32 uplink bytes (4·d per worker per step) / uplink bytes sent;
* paper ratio     = 32 / mean nominal uplink bits per coordinate (DQSGD Table 1's convention,
  which ignores norms, headers and the downlink [text]);
* total-traffic ratio = fp32 bytes of every message (uplink and downlink, 4·d each per worker and
  step; the all-gather topology has no downlink) / bytes of every message really sent (+ side);
* entropy-coded uplink ratio (``coded_ratio``) = fp32 uplink bytes of the measured steps / the
  uplink bytes of the same steps had every payload been coded with ``Coding.AUTO`` (the smallest
  of FIXED, Elias-ω, zstd-aligned and rANS; :func:`dqsgd.codecs.coded_size`, measured by really
  encoding the same levels), side traffic counted as in the measured ratio. Only the steps the
  trainer measured count (``train.coded_every = k``: the steps n with n % k == 0); beside it,
  ``sent_ratio_coded_steps`` is the measured ratio over those same steps. fp32 payloads count
  their own length.

Per rank, the ledger also keeps the bytes that cross the network links (:func:`wire_traffic`):
for each rank and phase, the larger of what it sends and what it receives (a full-duplex link
carries both at once, so the larger one sets the time), padding included, a rank's message to
itself excluded. The busiest rank's figure is what limits a step on a network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from dqsgd.topology.registry import SIMULATED_DEFAULT, topology_of, wire_traffic  # noqa: F401  (wire_traffic: re-exported)


@dataclass
class StepRecord:
    step: int
    bits: int                 # nominal uplink bits per coordinate this step
    up_bytes: list[int]       # per worker, measured
    down_bytes: int           # server -> each worker, measured (one broadcast message)
    side_bytes: int = 0       # extra per-worker traffic (e.g. TernGrad scaler sharing), both ways
    rank_up: list[int] = field(default_factory=list)    # per rank, uplink phase (wire_traffic)
    rank_down: list[int] = field(default_factory=list)  # per rank, downlink phase
    coded_up: list[int] | None = None  # per worker, the uplink with the best coding (None: not measured)
    dropped: list[int] = field(default_factory=list)  # backup workers: workers whose uplink was sent, not used


@dataclass
class Ledger:
    """Append-only account of one run's traffic. ``numel`` is d, the model dimension."""

    numel: int
    workers: int
    budget_bits: int | None = None   # per-worker uplink budget C, if the method has one
    records: list[StepRecord] = field(default_factory=list)
    topology: str = SIMULATED_DEFAULT
    both_legs: bool = False          # the budget counts the downlink too (sharded, downlink_bits = "auto")

    def record(self, step: int, bits: int, up_bytes: list[int], down_bytes: int, side_bytes: int = 0,
               rank_up: Sequence[int] = (), rank_down: Sequence[int] = (),
               coded_up: Sequence[int] | None = None, dropped: Sequence[int] = ()) -> StepRecord:
        """``down_bytes``: the downlink bytes each worker receives (sharded: all W shards' messages);
        ``coded_up``: per worker, the uplink's coded size (:func:`dqsgd.codecs.coded_size`; sharded:
        summed over the worker's W shard payloads), on the steps where it was measured."""
        if len(up_bytes) != self.workers:
            raise ValueError(f"ledger: {len(up_bytes)} uplink sizes for {self.workers} workers")
        if any(len(r) not in (0, self.workers) for r in (rank_up, rank_down)):
            raise ValueError(f"ledger: per-rank byte counts need {self.workers} entries")
        if coded_up is not None and len(coded_up) != self.workers:
            raise ValueError(f"ledger: {len(coded_up)} coded uplink sizes for {self.workers} workers")
        if any(b < 0 for b in [*up_bytes, down_bytes, side_bytes, *rank_up, *rank_down, *(coded_up or ())]):
            raise ValueError("ledger: byte counts must be >= 0")
        if any(not 0 <= w < self.workers for w in dropped) or len(set(dropped)) != len(dropped):
            raise ValueError(f"ledger: dropped workers {list(dropped)} are not distinct workers of {self.workers}")
        rec = StepRecord(step, bits, list(up_bytes), down_bytes, side_bytes, list(rank_up), list(rank_down),
                         None if coded_up is None else [int(b) for b in coded_up], sorted(int(w) for w in dropped))
        self.records.append(rec)
        return rec

    def record_coded(self, step: int, coded_up: Sequence[int]) -> None:
        """Add the coded uplink sizes of ``step`` (per worker) to its record, the last one."""
        last = self.records[-1] if self.records else None
        if last is None or last.step != step:
            raise ValueError(f"ledger: no record of step {step} to add coded sizes to")
        if len(coded_up) != self.workers or any(b < 0 for b in coded_up):
            raise ValueError(f"ledger: coded uplink sizes need {self.workers} entries >= 0, got {list(coded_up)}")
        last.coded_up = [int(b) for b in coded_up]

    def record_late(self, index: int, worker: int, nbytes: int) -> None:
        """A dropped worker's uplink of the ``index``-th recorded exchange arrived after it was served
        (backup workers over processes): its bytes were sent, not used — they count as wasted."""
        if not 0 <= index < len(self.records):
            raise ValueError(f"ledger: no exchange {index} to add a late uplink to ({len(self.records)} recorded)")
        rec = self.records[index]
        if worker not in rec.dropped or rec.up_bytes[worker] or nbytes < 0:
            raise ValueError(f"ledger: exchange {index}: worker {worker} was not dropped, or its late uplink was "
                             f"already counted")
        rec.up_bytes[worker] = int(nbytes)

    # --- totals -------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def up_bytes(self) -> int:
        return sum(sum(r.up_bytes) for r in self.records)

    @property
    def wasted_up_bytes(self) -> int:
        """Uplink bytes sent by workers whose gradients were dropped (backup workers)."""
        return sum(r.up_bytes[w] for r in self.records for w in r.dropped)

    @property
    def down_bytes(self) -> int:
        return sum(r.down_bytes for r in self.records) * self.workers

    @property
    def side_bytes(self) -> int:
        return sum(r.side_bytes for r in self.records) * self.workers

    def spent_bits(self) -> int:
        """Per-worker bits spent, what a budget is charged: the uplink (max over workers each step) and,
        where the budget counts both legs, the downlink bytes each worker received."""
        down = 8 * sum(r.down_bytes for r in self.records if r.up_bytes) if self.both_legs else 0
        return sum(8 * max(r.up_bytes) for r in self.records if r.up_bytes) + down

    def budget_left(self) -> int | None:
        return None if self.budget_bits is None else self.budget_bits - self.spent_bits()

    def fp32_up_bytes(self) -> int:
        return 4 * self.numel * self.workers * self.steps

    def compression_ratio(self) -> float:
        """Measured: fp32 uplink bytes / uplink bytes sent (inf if nothing was sent)."""
        sent = self.up_bytes + self.side_bytes // 2
        return self.fp32_up_bytes() / sent if sent else float("inf")

    def fp32_total_bytes(self) -> int:
        """Every message in fp32: the uplink, and as much again downlink unless the topology has none."""
        return self.fp32_up_bytes() * topology_of(self.topology).fp32_legs()

    def total_ratio(self) -> float:
        """Measured over all traffic: fp32 bytes of every message / bytes of every message sent."""
        sent = self.up_bytes + self.down_bytes + self.side_bytes
        return self.fp32_total_bytes() / sent if sent else float("inf")

    def busiest_rank_bytes(self) -> dict[str, float]:
        """Mean per step of the busiest rank's link bytes: uplink, downlink, and total (each maximised alone)."""
        recs = [r for r in self.records if r.rank_up]
        n = len(recs) or 1
        return {"rank_up_bytes": sum(max(r.rank_up) for r in recs) / n,
                "rank_down_bytes": sum(max(r.rank_down) for r in recs) / n,
                "rank_total_bytes": sum(max(a + b for a, b in zip(r.rank_up, r.rank_down)) for r in recs) / n}

    def coded_records(self) -> list[StepRecord]:
        """The steps whose uplink was also measured with the best coding."""
        return [r for r in self.records if r.coded_up is not None]

    def coded_up_bytes(self) -> int:
        """Σ over the measured steps and workers of the uplink's coded size."""
        return sum(sum(r.coded_up or ()) for r in self.records)

    def _ratio_on_coded_steps(self, sizes: Sequence[int]) -> float | None:
        """fp32 uplink bytes of the measured steps / (``sizes`` + their side uplink); None if none was measured."""
        recs = self.coded_records()
        if not recs:
            return None
        sent = sum(sizes) + sum(r.side_bytes for r in recs) * self.workers // 2
        return 4 * self.numel * self.workers * len(recs) / sent if sent else float("inf")

    def coded_ratio(self) -> float | None:
        """Entropy-coded uplink ratio over the measured steps (module docstring); None if none was measured."""
        return self._ratio_on_coded_steps([sum(r.coded_up or ()) for r in self.coded_records()])

    def sent_ratio_coded_steps(self) -> float | None:
        """The measured (as-sent) uplink ratio over the same steps as :meth:`coded_ratio`."""
        return self._ratio_on_coded_steps([sum(r.up_bytes) for r in self.coded_records()])

    def mean_bits(self) -> float:
        return sum(r.bits for r in self.records) / self.steps if self.steps else 0.0

    def paper_ratio(self) -> float:
        """DQSGD Table 1's convention: 32 / mean nominal bits per coordinate."""
        mb = self.mean_bits()
        return 32.0 / mb if mb else float("inf")

    def summary(self) -> dict[str, float | int | None]:
        return {
            "steps": self.steps,
            "up_bytes": self.up_bytes,
            "wasted_up_bytes": self.wasted_up_bytes,
            "down_bytes": self.down_bytes,
            "side_bytes": self.side_bytes,
            "fp32_up_bytes": self.fp32_up_bytes(),
            "compression_ratio": self.compression_ratio(),
            "total_ratio": self.total_ratio(),
            "paper_ratio": self.paper_ratio(),
            "topology": self.topology,
            **self.busiest_rank_bytes(),
            "mean_bits": self.mean_bits(),
            "budget_bits": self.budget_bits,
            "budget_left": self.budget_left(),
            "coded_steps": len(self.coded_records()),
            "coded_up_bytes": self.coded_up_bytes(),
            "coded_ratio": self.coded_ratio(),
            "sent_ratio_coded_steps": self.sent_ratio_coded_steps(),
        }

    # --- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        return {
            "numel": self.numel, "workers": self.workers, "budget_bits": self.budget_bits, "topology": self.topology,
            "both_legs": self.both_legs,
            "records": [[r.step, r.bits, list(r.up_bytes), r.down_bytes, r.side_bytes, list(r.rank_up), list(r.rank_down),
                         None if r.coded_up is None else list(r.coded_up), list(r.dropped)]
                        for r in self.records],
        }

    @classmethod
    def from_state_dict(cls, d: dict[str, object]) -> "Ledger":
        led = cls(int(d["numel"]), int(d["workers"]), d["budget_bits"],  # type: ignore[arg-type]
                  topology=str(d.get("topology", SIMULATED_DEFAULT)), both_legs=bool(d.get("both_legs", False)))
        for step, bits, up, down, side, *rest in d["records"]:  # type: ignore[union-attr]
            # older checkpoints: no per-rank accounting (5 fields), no coded sizes (7), no dropped workers (8)
            ru, rd, coded, dropped = [*rest, *[[], [], None, []][len(rest):]]
            led.records.append(StepRecord(int(step), int(bits), [int(b) for b in up], int(down), int(side),
                                          [int(b) for b in ru], [int(b) for b in rd],
                                          None if coded is None else [int(b) for b in coded],
                                          [int(w) for w in dropped]))
        return led
