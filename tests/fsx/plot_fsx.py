"""Draw docs/fsx.png from fsx results: operations per second and mismatches per seed.

Input: JSON lines, one per exerciser run (``FSX_RESULTS=FILE pytest tests/fsx ...`` appends
them, as does any script recording ``{"seed", "procs", "ops", "seconds",
"known_broken_excluded", "counts"}``). Needs matplotlib (``pip install -e '.[bench]'``)::

    python tests/fsx/plot_fsx.py results.jsonl docs/fsx.png
"""
from __future__ import annotations

import collections
import json
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: plot_fsx.py RESULTS.jsonl OUT.png", file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load(argv[0])
    runs.sort(key=lambda r: (not r.get("known_broken_excluded", False), r["seed"], r["procs"]))
    labels = [f"s{r['seed']} p{r['procs']}\n{'excl' if r.get('known_broken_excluded') else 'all'}" for r in runs]
    ops_s = [r["counts"].get("ops", 0) / r["seconds"] for r in runs]
    kinds = collections.Counter()
    for r in runs:
        for k, v in r["counts"].items():
            if k.startswith("mismatch:"):
                kinds[k.split(":", 1)[1]] += v
    top = [k for k, _ in kinds.most_common(8)]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    x = range(len(runs))
    a1.bar(x, ops_s, color="#4477aa")
    a1.set_ylabel("operations / s (all processes)")
    a1.set_title("fsx on kvfs (--ram 4MiB --nvme-size 16MiB), lockstep with an ext4 reference; "
                 "kill -9 + remount between phases", fontsize=10)
    for i, r in enumerate(runs):
        a1.text(i, ops_s[i], f"{r['counts'].get('ops', 0)} ops\nev {r['counts'].get('evicted', 0)}",
                ha="center", va="bottom", fontsize=7)
    bottom = [0] * len(runs)
    colors = plt.get_cmap("tab10")
    for j, k in enumerate(top + ["other"]):
        vals = []
        for r in runs:
            c = r["counts"]
            if k == "other":
                vals.append(sum(v for kk, v in c.items() if kk.startswith("mismatch:") and kk.split(":", 1)[1] not in top))
            else:
                vals.append(c.get("mismatch:" + k, 0))
        if any(vals):
            a2.bar(x, vals, bottom=bottom, label=k, color=colors(j))
            bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        c = r["counts"]
        a2.text(i, max(bottom[i], 0.5), f"{c.get('mismatch', 0)}\ncrash ok {c.get('crash_intact', 0)}",
                ha="center", va="bottom", fontsize=7)
    a2.set_ylabel("mismatches (by op kind that saw it)")
    a2.set_yscale("symlog")
    a2.legend(fontsize=7, ncol=3)
    a2.set_xticks(list(x))
    a2.set_xticklabels(labels, fontsize=7)
    a2.set_xlabel("seed, processes; excl = issue-11 KNOWN_BROKEN op kinds left out, all = every kind")
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]} from {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
