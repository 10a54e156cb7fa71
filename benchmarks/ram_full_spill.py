"""Writes while the RAM tier's tmpfs is full (spilled to NVMe) vs. while it has room, same run.

    python benchmarks/ram_full_spill.py [--files 64] [--rounds 5] [--json OUT]

One kvfs mount (RAM budget 768 MiB: a state's writes stay below its watermark; on the
daemon's own huge-page tmpfs when run as root).
Each round, in a rotated order, two states: "room" (the tmpfs has room) and "full" (another
file takes every free byte of the tmpfs: space the RAM tier's accounting does not know of,
kvfs/store/ramroom.py). In each state, ``--files`` new 2 MiB files written through the mount
(open, one write, close: the FUSE write path) and the same number of pages published by
``PageStore.write_many`` (``.kvfs/commit``, what the runtime adapters' ``set`` calls); every
file is read back and compared, and its tier checked (``ram`` with room, ``nvme`` when full).
The files are deleted after each measurement and the store settles before the next. Prints
GB/s medians (min-max) per path and state, and the full/room ratio.
"""
from __future__ import annotations

import argparse
import errno
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

SIZE = 2 << 20


def _fill(where: Path) -> int:
    """Take every free byte of ``where``'s filesystem with one file: its size."""
    n, chunk = 0, b"\x5a" * (8 << 20)
    with open(where / "bench-filler", "wb") as f:
        while True:
            try:
                n += os.write(f.fileno(), chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 4096:
                    return n
                chunk = chunk[:len(chunk) // 2]


def _settle(m: BenchMount, deadline: float = 120) -> None:
    end = time.monotonic() + deadline
    while not m.stats()["settled"]:
        if time.monotonic() > end:
            raise SystemExit("the store did not settle")
        time.sleep(0.05)


def _fuse_writes(d: Path, pages: list) -> float:
    d.mkdir()
    t0 = time.perf_counter()
    for i, p in enumerate(pages):
        with open(d / f"f{i:05d}", "wb") as f:
            f.write(p)
    return len(pages) * SIZE / (time.perf_counter() - t0) / 1e9


def _commit_writes(store: PageStore, tag: str, pages: list) -> float:
    names = [f"{tag}-{i:05d}" for i in range(len(pages))]
    t0 = time.perf_counter()
    if not all(store.write_many(names, lambda i: [pages[i]])):
        raise SystemExit(f"write_many failed: {store.statistics()}")
    return len(pages) * SIZE / (time.perf_counter() - t0) / 1e9


def _check_and_clean(files: list[Path], pages: list, tier: str) -> None:
    for f, p in zip(files, pages):
        with open(f, "rb") as fh:
            if fh.read() != p:
                raise SystemExit(f"{f}: wrong bytes")
        got = os.getxattr(f, "user.kvfs.tier").decode()
        if got != tier:
            raise SystemExit(f"{f}: on {got}, expected {tier}")
        os.unlink(f)


def _state(m: BenchMount, store: PageStore, tmpfs: Path, state: str, rnd: int, pages: list) -> dict:
    filler = _fill(tmpfs) if state == "full" else 0
    try:
        d = m.path / f"{state}-r{rnd}"
        fuse = _fuse_writes(d, pages)
        commit = _commit_writes(store, f"{state}-r{rnd}", pages)
    finally:
        if filler:
            os.unlink(tmpfs / "bench-filler")
    tier = "nvme" if state == "full" else "ram"
    _check_and_clean([d / f"f{i:05d}" for i in range(len(pages))], pages, tier)
    _check_and_clean([m.path / "pages" / f"{state}-r{rnd}-{i:05d}" for i in range(len(pages))], pages, tier)
    d.rmdir()
    _settle(m)
    return {"fuse": fuse, "commit": commit, "filler": filler}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    base = os.urandom(1 << 16)
    pages = [bytes((base * (SIZE // len(base) + 1))[i:i + SIZE]) for i in range(a.files)]
    root = Path(tempfile.mkdtemp(prefix="kvfs-ramfull-"))
    res: dict = {"load": os.getloadavg(), "files": a.files, "size": SIZE, "rounds": a.rounds,
                 "room": {"fuse": [], "commit": []}, "full": {"fuse": [], "commit": []}}
    try:
        with BenchMount(root / "m", ram="768MiB", nvme_size="8GiB", promote_hits=None) as m:
            st = m.stats()
            tmpfs = Path(st["ram_dir"]).parent
            res["ram_dir"] = st["ram_dir"]
            store = PageStore(m.path, "pages")
            try:
                _state(m, store, tmpfs, "room", -1, pages[:8])           # warm-up, not counted
                for rnd in range(a.rounds):
                    order = ["room", "full"] if rnd % 2 == 0 else ["full", "room"]
                    for state in order:
                        got = _state(m, store, tmpfs, state, rnd, pages)
                        for k in ("fuse", "commit"):
                            res[state][k].append(got[k])
                res["fs_spills"] = m.stats()["tiers"]["ram"]["fs_spills"]
            finally:
                store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for k in ("fuse", "commit"):
        room, full = res["room"][k], res["full"][k]
        ratio = [f / r for f, r in zip(full, room)]
        print(f"{k:6s}: room {statistics.median(room):.2f} GB/s ({min(room):.2f}-{max(room):.2f})  "
              f"full {statistics.median(full):.2f} GB/s ({min(full):.2f}-{max(full):.2f})  "
              f"full/room {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})", flush=True)
    print(f"write buffers spilled for want of tmpfs room: {res['fs_spills']}; "
          f"load at start {res['load'][0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
