"""Issue 39's checks on ``bench_network.py`` folders: does the link policy's row reach the target sooner
than every PowerSGD rank at 100 Mbit/s, no later than fp32 DDP at 1 Gbit/s, and within 10 % of the best
fixed row of its cell? The row is ``dqsgd-link`` where a folder has it (``bench_network.py`` runs it on
the measured link, ``--link-mbit 0``), else ``dqsgd`` (the link-w4-* folders, where that name ran the
link policy on a measured link). Rows other than the policy's and the stated-budget ``dqsgd@auto``
are the fixed rows.

    python benchmarks/network/link_checks.py results/network/link3-w4-mlp1024-100mbit [...]

Prints one Markdown row per (folder, rate): the medians over repeats, each check's answer, and the
mean uplink width and fp32-bytes ratio of that row's repeats (what the policy chose).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from net_tables import grouped, time_to_target  # noqa: E402

LINK_ROWS = ("dqsgd-link", "dqsgd")  # the first a folder has
NOT_FIXED = ("dqsgd-link", "dqsgd", "dqsgd@auto")
POWERSGD = ("powersgd", "powersgd-r2", "powersgd-r4")


def fmt(t: float | None) -> str:
    return "missed" if t is None else f"{t:.1f}"


def rows(folder: Path) -> list[str]:
    groups = grouped(json.loads((folder / "network.json").read_text())["runs"])
    out = []
    for rate in dict.fromkeys(r for r, _ in groups):
        times = {m: time_to_target(runs) for (r, m), runs in groups.items() if r == rate}
        row = next(m for m in LINK_ROWS if m in times)
        mine = times.get(row)
        fixed = {m: t for m, t in times.items() if m not in NOT_FIXED and t is not None}
        best = min(fixed, key=fixed.__getitem__) if fixed else None
        runs = groups[(rate, row)]
        chose = ", ".join(f"{r['mean_bits']:.2f} b / {r['payload_ratio']:.1f}x" for r in runs if r.get("mean_bits"))
        if rate == "100mbit":
            ps = [times.get(m) for m in POWERSGD]
            check = "yes" if mine is not None and all(t is None or mine < t for t in ps) else "**no**"
            what = f"sooner than every PowerSGD rank ({'/'.join(fmt(t) for t in ps)} s): {check}"
        else:
            fp32 = times.get("fp32")
            check = "yes" if mine is not None and fp32 is not None and mine <= fp32 else "**no**"
            what = f"no later than fp32 ({fmt(fp32)} s): {check}"
        within = "yes" if mine is not None and best is not None and mine <= 1.1 * fixed[best] else "**no**"
        out.append(f"| `{folder.name}` | {rate} | {fmt(mine)} | {what} | `{best}` {fmt(fixed.get(best))} s: "
                   f"{within} | {chose} |")
    return out


def main(argv: list[str]) -> int:
    print("| folder | rate | link policy (row `dqsgd-link`, or `dqsgd` in link-w4-*), time to target (s) | against PowerSGD / fp32 | best fixed row; "
          "within 10 % | its mean uplink bits / fp32-bytes ratio, per repeat |")
    print("|---|---|---|---|---|---|")
    for f in argv:
        print("\n".join(rows(Path(f))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
