"""A short demo workload for ``make run``: write KV-block files, watch them demote, read them back.

    python -m kvfs.demo MOUNTPOINT [--blocks 32] [--block-size 4MiB]

Blocks are written the way vLLM's file tier does it (temp file, one write, rename over the
final name) into ``<mount>/demo/<model>/<h[:3]>/<h[3:5]>_g0/<h>.bin``; writing more than the
RAM tier holds makes the oldest ones demote to NVMe, which ``user.kvfs.tier`` shows.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

from kvfs.config import parse_size

log = logging.getLogger(__name__)


def block_bytes(i: int, size: int) -> bytes:
    seed = hashlib.sha256(f"kvfs-demo-{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def block_path(root: Path, i: int) -> Path:
    h = hashlib.sha256(f"prefix-{i}".encode()).hexdigest()
    return root / "demo" / "tiny-llama_cfg0123456789_r0" / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin"


def tier_of(path: Path) -> str:
    try:
        return os.getxattr(path, "user.kvfs.tier").decode()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mountpoint", type=Path)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-size", default="4MiB")
    ap.add_argument("--wait", type=float, default=30.0, help="seconds to wait for demotion")
    args = ap.parse_args(argv)
    size = parse_size(args.block_size)
    root = args.mountpoint

    t0 = time.monotonic()
    for i in range(args.blocks):
        final = block_path(root, i)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + f"_{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_WRONLY, 0o644)
        try:
            os.write(fd, block_bytes(i, size))
        finally:
            os.close(fd)
        os.replace(tmp, final)
    dt = time.monotonic() - t0
    total = args.blocks * size
    print(f"wrote {args.blocks} blocks of {size >> 20} MiB ({total / dt / 1e6:.0f} MB/s)")

    deadline = time.monotonic() + args.wait
    while True:
        tiers = Counter(tier_of(block_path(root, i)) for i in range(args.blocks))
        if tiers.get("nvme") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print("placement after writing:", ", ".join(f"{n} on {t}" for t, n in sorted(tiers.items())))

    bad = 0
    t0 = time.monotonic()
    for i in range(args.blocks):
        with open(block_path(root, i), "rb") as f:
            if f.read() != block_bytes(i, size):
                bad += 1
                print(f"block {i}: WRONG CONTENT", file=sys.stderr)
    dt = time.monotonic() - t0
    print(f"re-read {args.blocks} blocks: {args.blocks - bad} intact, {bad} bad "
          f"({total / dt / 1e6:.0f} MB/s)")
    tiers = Counter(tier_of(block_path(root, i)) for i in range(args.blocks))
    print("placement after re-reading:", ", ".join(f"{n} on {t}" for t, n in sorted(tiers.items())))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
