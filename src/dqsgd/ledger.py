"""The communication ledger: bytes that really crossed the wire, step by step.

Every number here comes from ``len(payload)`` of a real message (never from a dtype or a formula),
next to the nominal bits per coordinate the method intended. Two compression ratios are reported,
and every report says which one it prints:

* measured ratio  = uncompressed fp32 uplink bytes (4·d per worker per step) / uplink bytes sent;
* paper ratio     = 32 / mean nominal uplink bits per coordinate (DQSGD Table 1's convention,
  which ignores norms, headers and the downlink [text]).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    step: int
    bits: int                 # nominal uplink bits per coordinate this step
    up_bytes: list[int]       # per worker, measured
    down_bytes: int           # server -> each worker, measured (one broadcast message)
    side_bytes: int = 0       # extra per-worker traffic (e.g. TernGrad scaler sharing), both ways


@dataclass
class Ledger:
    """Append-only account of one run's traffic. ``numel`` is d, the model dimension."""

    numel: int
    workers: int
    budget_bits: int | None = None   # per-worker uplink budget C, if the method has one
    records: list[StepRecord] = field(default_factory=list)

    def record(self, step: int, bits: int, up_bytes: list[int], down_bytes: int, side_bytes: int = 0) -> StepRecord:
        if len(up_bytes) != self.workers:
            raise ValueError(f"ledger: {len(up_bytes)} uplink sizes for {self.workers} workers")
        if any(b < 0 for b in up_bytes) or down_bytes < 0 or side_bytes < 0:
            raise ValueError("ledger: byte counts must be >= 0")
        rec = StepRecord(step, bits, list(up_bytes), down_bytes, side_bytes)
        self.records.append(rec)
        return rec

    # --- totals -------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def up_bytes(self) -> int:
        return sum(sum(r.up_bytes) for r in self.records)

    @property
    def down_bytes(self) -> int:
        return sum(r.down_bytes for r in self.records) * self.workers

    @property
    def side_bytes(self) -> int:
        return sum(r.side_bytes for r in self.records) * self.workers

    def spent_bits(self) -> int:
        """Per-worker uplink bits spent (max over workers each step): what a budget is charged."""
        return sum(8 * max(r.up_bytes) for r in self.records if r.up_bytes)

    def budget_left(self) -> int | None:
        return None if self.budget_bits is None else self.budget_bits - self.spent_bits()

    def fp32_up_bytes(self) -> int:
        return 4 * self.numel * self.workers * self.steps

    def compression_ratio(self) -> float:
        """Measured: fp32 uplink bytes / uplink bytes sent (inf if nothing was sent)."""
        sent = self.up_bytes + self.side_bytes // 2
        return self.fp32_up_bytes() / sent if sent else float("inf")

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
            "down_bytes": self.down_bytes,
            "side_bytes": self.side_bytes,
            "fp32_up_bytes": self.fp32_up_bytes(),
            "compression_ratio": self.compression_ratio(),
            "paper_ratio": self.paper_ratio(),
            "mean_bits": self.mean_bits(),
            "budget_bits": self.budget_bits,
            "budget_left": self.budget_left(),
        }

    # --- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        return {
            "numel": self.numel, "workers": self.workers, "budget_bits": self.budget_bits,
            "records": [[r.step, r.bits, list(r.up_bytes), r.down_bytes, r.side_bytes] for r in self.records],
        }

    @classmethod
    def from_state_dict(cls, d: dict[str, object]) -> "Ledger":
        led = cls(int(d["numel"]), int(d["workers"]), d["budget_bits"])  # type: ignore[arg-type]
        for step, bits, up, down, side in d["records"]:  # type: ignore[union-attr]
            led.records.append(StepRecord(int(step), int(bits), [int(b) for b in up], int(down), int(side)))
        return led
