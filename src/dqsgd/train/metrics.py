"""Metrics: one JSON line per step (only the writing rank writes); tables are built from these files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class JsonlWriter:
    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                # A run killed mid-write leaves at most one partial last line; anything else is corrupt.
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only records with step <= last_step (used when resuming from a checkpoint)."""
    if not path.exists():
        return
    keep = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            if int(rec.get("step", -1)) <= last_step:
                keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    tmp.replace(path)
