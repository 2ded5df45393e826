"""Where and when a comparison ran, for the head of its report: machine, date, commit.

Read from each run's ``config.json`` ``environment`` (:func:`dqsgd.train.rundir.environment`); runs
written before it recorded ``gpu``, ``date`` or ``commit`` fall back to "not recorded" and to the
modification date of ``metrics.jsonl``.
"""

from __future__ import annotations

import datetime
from typing import Any


def _span(values: list[str]) -> str:
    values = sorted(set(values))
    return values[0] if len(values) == 1 else f"{values[0]} to {values[-1]}"


def provenance(runs: list[Any]) -> str:
    """One Markdown paragraph: the machine(s), the dates and the commit(s) of ``runs``."""
    machines, dates, commits = [], [], []
    for r in runs:
        env = r.facts.get("environment", {})
        gpu = env.get("gpu", "not recorded")
        machines.append(f"{env.get('cpu', 'CPU not recorded')}, {env.get('cpu_count', '?')} cores, "
                        f"GPU: {gpu or 'none'}")
        date = env.get("date") or datetime.datetime.fromtimestamp(
            (r.path / "metrics.jsonl").stat().st_mtime, datetime.timezone.utc).strftime("%Y-%m-%d")
        dates.append(date[:10])
        commits.append(env.get("commit") or "not recorded")
    return (f"**Where and when.** Machine: {'; '.join(sorted(set(machines)))}. Date (UTC): {_span(dates)}. "
            f"dqsgd commit: {', '.join(sorted(set(commits)))}. The exact commands are under *Reproduce*.")
