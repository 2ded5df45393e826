"""Metrics: one JSON line per step (only the writing rank writes); tables are built from these files."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator

from dqsgd.train.runfiles import RunDataError, atomic_write, open_text, read_lines


@dataclass
class StepResult:
    """What one training step did and measured: its loss, width, bytes and times (one metrics line)."""

    step: int
    loss: float
    lr: float
    bits: int
    skipped: bool
    up_bytes: list[int]
    down_bytes: int
    side_bytes: int
    compute_s: float
    encode_s: float
    decode_s: float
    coded_up: list[int] | None = None  # per worker, the uplink with the best coding (measured steps only)
    coded_s: float = 0.0               # seconds this process spent measuring it (not in encode_s/decode_s)
    sim_time_s: float = 0.0            # the simulated wall clock after this step (dqsgd.train.slownodes)
    dropped: list[int] | None = None   # backup workers: the workers whose gradients this step dropped


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class JsonlWriter:
    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open_text(path, "a" if append else "w")  # never through a link planted in the run dir

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _parsed(path: Path, max_line: int | None = None) -> Iterator[tuple[int, str, dict[str, Any] | None]]:
    """(line number, line, record or None when the line is not a JSON object) for every non-blank line,
    read one bounded line at a time (:func:`dqsgd.train.runfiles.read_lines`). A number Python
    refuses (an integer of more than 4300 digits) is :class:`RunDataError` naming the file and line."""
    for n, raw in read_lines(path, max_line=max_line):
        line = raw.decode("utf-8", errors="replace")
        text = line.strip().strip("\x00")
        if not text:
            continue
        try:
            rec = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            rec = None
        except ValueError as e:
            raise RunDataError(f"{path}:{n}: unreadable number ({e})") from None
        yield n, line, rec if isinstance(rec, dict) else None


def _warn_skipped(path: Path, skipped: list[int], why: str, total: int | None = None) -> None:
    """One stderr line naming the first skipped lines (``total``: how many in all, when only the first are kept)."""
    total = len(skipped) if total is None else total
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (f" and {total - 10} more" if total > 10 else "")
        print(f"dqsgd: warning: {path}: skipped line(s) {shown}: not a JSON record ({why})", file=sys.stderr, flush=True)


def read_jsonl(path: Path, numbered: bool = False, max_line: int | None = None) -> Iterator[Any]:
    """Every valid record of ``path`` (``numbered``: as (line number, record)). A line that is not
    a JSON object (a torn last line after a crash, a damaged line) is skipped and named on stderr:
    the valid records around it are kept."""
    skipped: list[int] = []  # the first 10 only: the file is streamed, whatever its length
    total = 0
    for n, _, rec in _parsed(path, max_line):
        if rec is None:
            total += 1
            if total <= 10:
                skipped.append(n)
        else:
            yield (n, rec) if numbered else rec
    _warn_skipped(path, skipped, "a torn or damaged line", total)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only records with step <= last_step (used when resuming from a checkpoint).

    Damaged lines are dropped (and named on stderr); every valid record up to ``last_step`` is kept,
    also those after a damaged line. The file is replaced atomically.
    """
    if not path.exists():
        return
    keep, skipped = [], []
    for n, line, rec in _parsed(path):
        if rec is None or not isinstance(rec.get("step", -1), int):
            skipped.append(n)
        elif rec.get("step", -1) <= last_step:
            keep.append(line if line.endswith("\n") else line + "\n")
    _warn_skipped(path, skipped, "dropped on resume")
    atomic_write(path, "".join(keep))
