"""Which parts of a ``.kvfs/commit`` caller's memory are mappings of a file of this mount.

A ``\\0mem`` entry is read with ``process_vm_readv``; a range the caller mapped from a file
of this very mount would make the daemon's copier thread fault in pages that only the
daemon's own request loop can serve: the daemon waiting on itself (its copier slots held
by reads that depend on its own loop). Such
entries answer EXDEV before anything is read -- as a descriptor of this mount does for
``\\0fd`` -- and the client sends them through its memfd (its own copy faults them in).

Read from ``/proc/<pid>/maps`` in a worker thread: the read takes the caller's mmap lock,
which a thread of the caller faulting on this mount may hold while it waits for us.
"""
from __future__ import annotations

import bisect
import os


def mount_spans(tgid: int, dev: int) -> list[tuple[int, int]]:
    """Sorted ``(start, end)`` of the mappings of process ``tgid`` backed by a file on device
    ``dev``; empty when none (or the process is gone: its reads then fail on their own)."""
    if dev < 0:
        return []
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    out = []
    try:
        with open(f"/proc/{tgid}/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) > 4 and fields[4] != "0" and _same_dev(fields[3], want, dev):
                    lo, _, hi = fields[0].partition("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except (OSError, ValueError):
        return []
    out.sort()
    return out


def _same_dev(field: str, want: str, dev: int) -> bool:
    if field == want:
        return True
    try:
        major, minor = field.split(":")
        return os.makedev(int(major, 16), int(minor, 16)) == dev
    except ValueError:
        return False


def overlaps(spans: list[tuple[int, int]], ranges) -> bool:
    """Whether any ``(address, length)`` of ``ranges`` touches one of ``spans``."""
    if not spans:
        return False
    starts = [s for s, _ in spans]
    for addr, length in ranges:
        if length <= 0:
            continue
        i = bisect.bisect_right(starts, addr + length - 1) - 1
        if i >= 0 and spans[i][1] > addr:
            return True
    return False
