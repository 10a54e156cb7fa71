"""The per-call cost of an existence miss: ``PageStore.prefix([name])`` of a page that does not
exist (one name per call, as SGLang and vLLM ask) on a kvfs mount, against
``os.path.exists`` of the same names in a plain directory of the host disk, interleaved rounds.

    python benchmarks/exists_miss_ab.py [--calls 20000] [--rounds 5] [--dir DIR]

Prints one JSON line: medians of the per-call µs, the ratio ext4/kvfs per round (median, min,
max; higher is better, 1.0 = as fast as ext4), the table misses the store counted and the load
average. To compare two builds, run it with each on ``PYTHONPATH``, alternately.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.bench import BenchMount, wait_for  # noqa: E402
from kvfs.integrations.pages import PageStore  # noqa: E402

log = logging.getLogger("exists_miss_ab")


def per_call_us(fn, names: list[str]) -> float:
    t0 = time.perf_counter_ns()
    for n in names:
        fn(n)
    return (time.perf_counter_ns() - t0) / len(names) / 1000


def measure(root: Path, calls: int, rounds: int) -> tuple[list[float], list[float], int]:
    plain = root / "plain"
    plain.mkdir()
    with BenchMount(root / "m", ram="256MiB", nvme_size="1GiB") as m:
        wait_for(lambda: m.stats()["names"], 120)       # the name table is built after mount
        store = PageStore(m.path, "pages")
        have = [f"h{i:060x}.bin" for i in range(200)]
        store.write_many(have, lambda i: [b"x" * 4096])
        for n in have:
            (plain / n).touch()
        names = [f"f{i:062x}.bin" for i in range(calls)]
        kv, ext = [], []
        for _ in range(rounds):
            kv.append(per_call_us(lambda n: store.prefix([n]), names))
            ext.append(per_call_us(lambda n: os.path.exists(os.path.join(plain, n)), names))
        st = store.statistics()
        table_misses = (st.table_misses, getattr(st, "table_stats", None))   # stats: None before issue 13's cache
        store.close()
    return kv, ext, table_misses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="scratch directory (default: the system's temp dir)")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="exists-ab-", dir=args.dir))
    try:
        kv, ext, table_misses = measure(root, args.calls, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = [e / k for e, k in zip(ext, kv)]
    print(json.dumps({"kvfs_us": round(statistics.median(kv), 2), "ext4_us": round(statistics.median(ext), 2),
                      "ratio": round(statistics.median(ratios), 2), "min": round(min(ratios), 2),
                      "max": round(max(ratios), 2), "table_misses": table_misses[0], "table_stats": table_misses[1],
                      "load": round(os.getloadavg()[0], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
