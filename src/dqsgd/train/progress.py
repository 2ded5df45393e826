"""What a long run shows on the terminal: a step bar per run, each evaluation, and a comparison's progress.

* :func:`step_bar` — the bar of one run (tqdm, the ``[cli]`` extra; a silent stand-in without it or
  off a terminal).
* :func:`eval_line` — one line per evaluation with its duration, on a terminal (an evaluation of a large model takes
  minutes: without it the bar would only show a slow step).
* :class:`CompareProgress` — "run k of N", total elapsed time and an ETA, and one line per finished run
  that stays on screen (the step bars of the runs disappear when the run ends).

The ETA of a comparison is (elapsed / runs done by this command) × runs left: every run of a comparison
has the same number of steps, so the mean time per run is the natural estimate; runs kept by
``--resume`` take no time and are not counted.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from dqsgd.core.extras import available

_WARNED: list[bool] = []


class NullBar:
    """The bar's interface, doing nothing: progress off, or tqdm not installed."""

    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...
    def set_description_str(self, desc: str = "", refresh: bool = True) -> None: ...
    def close(self) -> None: ...


def on_terminal() -> bool:
    """Whether stderr (where the bars and the evaluation lines go) is a terminal: in a log file a bar
    is hundreds of cursor-control lines, so off a terminal only the finished runs' lines are printed."""
    return sys.stderr.isatty()


def _tqdm() -> Any | None:
    """tqdm's class, or None: off a terminal, or (with a one-time note on stderr) when the ``[cli]``
    extra is absent."""
    if available("tqdm"):
        from tqdm.auto import tqdm

        return tqdm if on_terminal() else None
    if not _WARNED:
        _WARNED.append(True)
        print("dqsgd: progress bars need tqdm (pip install 'dqsgd[cli]'); continuing with lines only",
              file=sys.stderr)
    return None


def write(line: str) -> None:
    """A line above the open bars (tqdm.write keeps them intact), or a plain print without tqdm."""
    if available("tqdm"):
        from tqdm.auto import tqdm

        tqdm.write(line)
    else:
        print(line, flush=True)


def step_bar(total: int, initial: int, desc: str, enabled: bool) -> Any:
    """The step bar of one run; it disappears when the run ends (its result line stays)."""
    bar_cls = _tqdm() if enabled else None
    if bar_cls is None:
        return NullBar()
    return bar_cls(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True)


def eval_line(label: str, step: int, acc: float, loss: float, seconds: float) -> str:
    return f"  {label}: eval at step {step}: test acc {100 * acc:.2f}%, loss {loss:.4f} ({seconds:.1f} s)"


def clock(seconds: float) -> str:
    """``H:MM:SS`` (or ``M:SS`` under an hour)."""
    s = int(round(max(seconds, 0.0)))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class CompareProgress:
    """Overall progress of a comparison of ``total`` runs: an overall bar and one line per finished run."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.k = 0            # runs handled (run, or kept by --resume)
        self.ran = 0          # runs trained by this command: the ETA's denominator
        self.start = time.perf_counter()
        bar_cls = _tqdm() if enabled else None
        self.bar = NullBar() if bar_cls is None else bar_cls(
            total=total, desc="compare", unit="run", leave=False, dynamic_ncols=True, smoothing=0.0,
            bar_format="{desc}: run {n_fmt}/{total_fmt} |{bar}| elapsed {elapsed}, ETA {remaining}")

    def eta(self) -> float:
        """Seconds left: mean seconds per run trained so far × runs left (NaN before the first run ends)."""
        if not self.ran:
            return float("nan")
        return (time.perf_counter() - self.start) / self.ran * (self.total - self.k)

    def _line(self, text: str) -> None:
        if not self.enabled:
            return
        eta = self.eta()
        left = "?" if eta != eta else clock(eta)
        write(f"[{self.k:>{len(str(self.total))}}/{self.total}] {text} | elapsed "
              f"{clock(time.perf_counter() - self.start)}, ETA {left}")

    def kept(self, label: str, seed: int) -> None:
        """A run that ``--resume`` keeps as it is (finished before)."""
        self.k += 1
        self.bar.update(1)
        self._line(f"{label} seed {seed}: finished earlier, kept")

    def finished(self, summary: dict[str, Any]) -> None:
        """A run that just ended: its one-line result stays on screen."""
        self.k += 1
        self.ran += 1
        self.bar.update(1)
        coded = summary.get("ledger_coded_ratio")
        self._line(f"{summary['method']} seed {summary['seed']}: test acc {100 * summary['test_acc']:.2f}%, "
                   f"ratio {summary['ledger_compression_ratio']:.2f}"
                   + (f" (entropy-coded {coded:.2f})" if coded is not None else "")
                   + f", mean bits {summary['ledger_mean_bits']:.2f}, {summary['wall_s']:.0f} s")

    def close(self) -> None:
        """The bar goes; one line stays (the bar's last state would otherwise print a second time)."""
        self.bar.close()
        if self.enabled:
            kept = f" ({self.k - self.ran} kept)" if self.k > self.ran else ""
            write(f"compare: {self.k} of {self.total} runs{kept} in {clock(time.perf_counter() - self.start)}")


def result_line(s: dict[str, Any]) -> str:
    """A finished run's accuracy and traffic in one line (``dqsgd train``, simulated or distributed)."""
    coded = s.get("ledger_coded_ratio")
    coded_text = "" if coded is None else (
        f", entropy-coded (auto) uplink ratio {coded:.2f} (over {s['ledger_coded_steps']} measured steps)")
    return (f"{s['method']}: test acc {100 * s['test_acc']:.2f}%, uplink ratio {s['ledger_compression_ratio']:.2f} "
            f"(fixed-width, paper's convention){coded_text}, total-traffic ratio {s['ledger_total_ratio']:.2f}, "
            f"mean bits {s['ledger_mean_bits']:.2f}, uplink {s['ledger_up_bytes'] / 1e6:.2f} MB")
