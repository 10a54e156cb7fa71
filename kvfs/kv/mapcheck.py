"""Whether a buffer of this process is a mapping of a file on a FUSE filesystem.

O_DIRECT reads a file straight into the destination's pages: the kernel pins them, and a
page not yet present is faulted in first -- for a mapping of a file of a FUSE mount, by a
request to that mount's daemon, while the read holds the backing file's inode lock. A kvfs
daemon that needs that lock (a hard link for a namespace owner, an unlink) and is killed then
stays in uninterruptible sleep, cannot exit, and wedges the mount. So a leased page is read
with O_DIRECT straight into a destination only when that destination is not such a mapping
(otherwise through the reader's own aligned buffer, kvfs.integrations.leased).

``/proc/self/maps`` is read once per batch of reads (:func:`batch`, around a call that reads
many pages) or per check outside one -- never cached across calls: an address freed and
mapped again from a file of the mount is common.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading

_local = threading.local()


def _fuse_devs() -> set[int]:
    out = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                if " - " not in line:
                    continue
                fstype = line.split(" - ", 1)[1].split()[0]
                if fstype == "fuse" or fstype.startswith(("fuse.", "fuseblk")):
                    major, minor = line.split()[2].split(":")
                    out.add(os.makedev(int(major), int(minor)))
    except (OSError, ValueError, IndexError):
        pass
    return out


def _load() -> list[tuple[int, int, bool]]:
    """Every mapping of this process: (start, end, maps a FUSE file), in address order."""
    devs, out = _fuse_devs(), []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) < 5:
                continue
            lo, _, hi = fields[0].partition("-")
            major, _, minor = fields[3].partition(":")
            fuse = fields[4] != "0" and os.makedev(int(major, 16), int(minor, 16)) in devs
            out.append((int(lo, 16), int(hi, 16), fuse))
    return out


@contextlib.contextmanager
def batch():
    """Checks in this thread share one reading of the maps until the block ends (a call
    that reads many pages into buffers it was given and maps nothing meanwhile)."""
    outer = getattr(_local, "maps", False)
    _local.maps = None                  # read at the first check
    try:
        yield
    finally:
        _local.maps = outer


def maps_fuse_file(mv: memoryview) -> bool:
    """True when any byte of the writable buffer ``mv`` lies in a mapping of a FUSE file (or
    its address cannot be told, or lies outside every mapping: then it is treated as one)."""
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError):
        return True
    end = start + max(len(mv), 1)
    maps = getattr(_local, "maps", False)
    try:
        if not maps:
            loaded = _load()
            if maps is None:            # in a batch: kept for its other checks
                _local.maps = loaded
            maps = loaded
    except OSError:
        return True
    covered = start
    for lo, hi, fuse in maps:
        if hi <= covered or lo >= end:
            continue
        if fuse or lo > covered:
            return True
        covered = hi
        if covered >= end:
            return False
    return True
