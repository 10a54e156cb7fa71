"""The adapters' set with the RAM tier on the daemon's own huge-page tmpfs and in /dev/shm.

    python benchmarks/ram_hugefs_ab.py [--pages 300] [--rounds 3] [--json OUT]

Two kvfs mounts side by side, ``ram_hugefs = true`` (the default: a tmpfs mounted
``huge=within_size`` by the daemon, kvfs/store/hugefs.py) and ``ram_hugefs = false`` (the RAM
tier in /dev/shm itself), and a plain directory on the host disk. Each round, in a rotated
order, ``PageStore.write_many`` (what all three runtime adapters' ``set`` calls) of ``--pages``
new pages of 2 MiB and of 256 KiB into each kvfs mount in batches of 128, and the same pages
written to the plain directory as files (open, write, close: one page-cache copy). Prints
GB/s medians (min-max) and the per-round ratios.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvfs.bench import BenchMount  # noqa: E402
from kvfs.integrations.pages import PageStore  # noqa: E402

SIZES = {"2 MiB": 2 << 20, "256 KiB": 256 << 10}
BATCH = 128


def _pages(n: int, size: int) -> list[bytearray]:
    base = os.urandom(1 << 16)
    return [bytearray((base * (size // len(base) + 1))[:size]) for _ in range(n)]


def _kvfs_set(store: PageStore, tag: str, pages: list) -> float:
    names = [f"{tag}-{i:06d}" for i in range(len(pages))]
    t0 = time.perf_counter()
    for k in range(0, len(pages), BATCH):
        ok = store.write_many(names[k:k + BATCH], lambda i, k=k: [pages[k + i]])
        if not all(ok):
            raise SystemExit(f"write_many failed: {store.statistics()}")
    return sum(len(p) for p in pages) / (time.perf_counter() - t0) / 1e9


def _plain_set(d: Path, tag: str, pages: list) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(pages):
        with open(d / f"{tag}-{i:06d}", "wb") as f:
            f.write(p)
    return sum(len(p) for p in pages) / (time.perf_counter() - t0) / 1e9


def _measure(label: str, pages: list, stores: dict, plain: Path, rounds: int) -> dict[str, list[float]]:
    """Per round, in a rotated order: each kvfs mount's ``write_many`` and the plain files."""
    targets = ["hugefs", "dev_shm", "plain"]
    rates: dict[str, list[float]] = {t: [] for t in targets}
    for rnd in range(rounds):
        for t in targets[rnd % 3:] + targets[:rnd % 3]:
            tag = f"{label.replace(' ', '')}-r{rnd}"
            rates[t].append(_plain_set(plain, tag, pages) if t == "plain" else _kvfs_set(stores[t], tag, pages))
    med = {t: statistics.median(v) for t, v in rates.items()}
    ratio = [h / s for h, s in zip(rates["hugefs"], rates["dev_shm"])]
    print(f"{label}: " + "  ".join(f"{t} {med[t]:.2f} GB/s ({min(rates[t]):.2f}-{max(rates[t]):.2f})"
                                   for t in targets)
          + f"  hugefs/dev_shm {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})"
          + f"  hugefs/plain {med['hugefs'] / med['plain']:.2f}x  dev_shm/plain {med['dev_shm'] / med['plain']:.2f}x",
          flush=True)
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvfs-hugefs-ab-"))
    ram = f"{(len(SIZES) * a.rounds * a.pages * (2 << 20) * 9 // 8 >> 20) + 256}MiB"
    mounts = {"hugefs": BenchMount(root / "huge", ram=ram, nvme_size="8GiB", promote_hits=None),
              "dev_shm": BenchMount(root / "shm", ram=ram, nvme_size="8GiB", promote_hits=None, ram_hugefs=False)}
    plain = root / "plain"
    plain.mkdir()
    res: dict = {"load": os.getloadavg(), "pages": a.pages, "rounds": a.rounds}
    try:
        with contextlib.ExitStack() as stack:
            stores = {}
            for name, m in mounts.items():
                stack.enter_context(m)                 # mounted now, unmounted on the way out
                stores[name] = stack.enter_context(contextlib.closing(PageStore(m.path, "pages")))
                res[f"{name}_ram_dir"] = json.loads((m.path / ".kvfs" / "stats").read_text())["ram_dir"]
            for label, size in SIZES.items():
                res[label] = _measure(label, _pages(a.pages, size), stores, plain, a.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load at start {res['load'][0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
