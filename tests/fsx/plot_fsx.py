"""Draw docs/fsx.png from fsx results: throughput, crash checks and mismatches per run.

Input: JSON lines, one per exerciser run (``FSX_RESULTS=FILE pytest tests/fsx ...`` appends
them, as does any script recording ``{"seed", "procs", "ops", "seconds", "phases",
"counts"}``). Needs matplotlib (``pip install -e '.[bench]'``)::

    python tests/fsx/plot_fsx.py results.jsonl docs/fsx.png
"""
from __future__ import annotations

import json
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _throughput(ax, runs: list[dict]) -> None:
    ops_s = [r["counts"].get("ops", 0) / r["seconds"] for r in runs]
    ax.bar(range(len(runs)), ops_s, color="#4477aa")
    ax.set_ylabel("operations / s (all processes)")
    total = sum(r["counts"].get("ops", 0) for r in runs)
    kills = sum(r.get("phases", 1) - 1 for r in runs)
    ax.set_title(f"fsx on kvfs (--ram 4MiB --nvme-size 16MiB) in lockstep with an ext4 reference: "
                 f"{total:,} operations, {kills} kill -9 + remount", fontsize=10)
    for i, r in enumerate(runs):
        c = r["counts"]
        ax.text(i, ops_s[i], f"{c.get('ops', 0):,} ops\nevicted {c.get('evicted', 0)}",
                ha="center", va="bottom", fontsize=7)


def _crash_checks(ax, runs: list[dict]) -> None:
    x = range(len(runs))
    intact = [r["counts"].get("crash_intact", 0) for r in runs]
    absent = [r["counts"].get("crash_absent", 0) for r in runs]
    ax.bar(x, intact, color="#228833", label="last sealed version")
    ax.bar(x, absent, bottom=intact, color="#bbbbbb", label="absent (only in RAM, or never sealed)")
    for i, r in enumerate(runs):
        c = r["counts"]
        bad = c.get("mismatch", 0)
        ax.text(i, intact[i] + absent[i], f"{bad} mismatch{'es' if bad != 1 else ''}\n"
                f"{c.get('crash_mismatch', 0)} wrong after kill",
                ha="center", va="bottom", fontsize=7, color="#cc3311" if bad else "black")
    ax.set_ylabel("files checked after kill -9")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"seed {r['seed']}\n{r['procs']} proc\n{r.get('phases', 1)} phases" for r in runs],
                       fontsize=7)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: plot_fsx.py RESULTS.jsonl OUT.png", file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(load(argv[0]), key=lambda r: (r["procs"], r["seed"]))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    _throughput(a1, runs)
    _crash_checks(a2, runs)
    a1.set_ylim(0, a1.get_ylim()[1] * 1.2)
    a2.set_ylim(0, a2.get_ylim()[1] * 1.2)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]} from {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
