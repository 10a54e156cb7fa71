"""Whether a buffer of this process is a mapping of a file on a FUSE filesystem.

O_DIRECT reads a file straight into the destination's pages: the kernel pins them, and a
page not yet present is faulted in first -- for a mapping of a file of a FUSE mount, by a
request to that mount's daemon, while the read holds the backing file's inode lock. A kvfs
daemon that needs that lock (a hard link for a namespace owner, an unlink) and is killed then
stays in uninterruptible sleep, cannot exit, and wedges the mount. So a leased page is read
with O_DIRECT straight into a destination only when that destination is not such a mapping
(otherwise through the reader's own aligned buffer, kvfs.integrations.leased).

Where the kernel answers ``PROCMAP_QUERY`` (Linux 6.11+) each check asks it for the mappings
covering the buffer (a few microseconds); elsewhere ``/proc/self/maps`` is read, once per batch
of reads (:func:`batch`, around a call that reads many pages) or per check outside one --
never cached across calls: an address freed and mapped again from a file of the mount is
common.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import struct
import threading

_local = threading.local()
_QUERY = struct.Struct("<QQQQQQQQQIIIIQQ")       # struct procmap_query (104 bytes)
PROCMAP_QUERY = 0xC0686611                      # _IOWR('f', 17, struct procmap_query)
FUSECTL = "/sys/fs/fuse/connections"
_query_fd: list[int] = []                       # [/proc/self/maps or -1 (no PROCMAP_QUERY), pid]
_query_lock = threading.Lock()
_fusectl: list[bool] = []                       # fusectl seen mounted


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


def _is_fuse(dev: int) -> bool:
    """Whether device ``dev`` is a FUSE connection's: fusectl, where mounted, lists every
    connection by its minor; else the mount table says."""
    if os.major(dev) != 0:
        return False
    if os.path.isdir(f"{FUSECTL}/{os.minor(dev)}"):
        return True
    if not _fusectl and os.path.ismount(FUSECTL):
        _fusectl.append(True)
    return False if _fusectl else dev in _fuse_devs()


def _query(addr: int) -> tuple[int, int, int] | None:
    """``(start, end, device of its file or -1)`` of the mapping covering ``addr``; None when
    none covers it. OSError(ENOTTY) where the kernel has no PROCMAP_QUERY."""
    with _query_lock:
        if _query_fd and _query_fd[0] >= 0 and _query_fd[1] != os.getpid():
            os.close(_query_fd[0])      # inherited across fork(): it describes the parent
            _query_fd.clear()
        if not _query_fd:
            try:
                _query_fd[:] = [os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC), os.getpid()]
            except OSError:
                _query_fd[:] = [-1, os.getpid()]
        fd = _query_fd[0]
    if fd < 0:
        raise OSError(errno.ENOTTY, "no PROCMAP_QUERY")
    buf = bytearray(_QUERY.pack(_QUERY.size, 0, addr, *([0] * 12)))
    try:
        fcntl.ioctl(fd, PROCMAP_QUERY, buf)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None
        if e.errno in (errno.ENOTTY, errno.EINVAL):
            _query_fd[0] = -1
        raise
    _, _, _, lo, hi, _, _, _, ino, major, minor = _QUERY.unpack(bytes(buf))[:11]
    return lo, hi, (os.makedev(major, minor) if ino else -1)


def _load() -> list[tuple[int, int, int]]:
    """Every mapping of this process: (start, end, device of its file or -1), in address order."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            rng, _, _, dev, ino = line.split(None, 5)[:5]
            lo, _, hi = rng.partition("-")
            if ino == "0":
                out.append((int(lo, 16), int(hi, 16), -1))
            else:
                major, _, minor = dev.partition(":")
                out.append((int(lo, 16), int(hi, 16), os.makedev(int(major, 16), int(minor, 16))))
    return out


@contextlib.contextmanager
def batch():
    """Checks in this thread share one reading of the maps until the block ends (a call
    that reads many pages into buffers it was given and maps nothing meanwhile); with
    PROCMAP_QUERY nothing is read ahead."""
    outer = getattr(_local, "maps", False)
    _local.maps = None                  # read at the first check that needs them
    try:
        yield
    finally:
        _local.maps = outer


def _covering(start: int, end: int):
    """The mappings over ``[start, end)``, in order: by PROCMAP_QUERY, else from the maps."""
    try:
        at = start
        while at < end:
            m = _query(at)
            if m is None:
                yield (at, at + 1, -1, True)    # a hole
                return
            yield (*m, False)
            at = m[1]
        return
    except OSError:
        if at != start:
            raise
    maps = getattr(_local, "maps", False)
    if not maps:
        loaded = _load()
        if maps is None:                # in a batch: kept for its other checks
            _local.maps = loaded
        maps = loaded
    covered = start
    for lo, hi, dev in maps:
        if hi <= covered or lo >= end:
            continue
        if lo > covered:
            yield (covered, lo, -1, True)
            return
        yield (lo, hi, dev, False)
        covered = hi
        if covered >= end:
            return
    yield (covered, end, -1, True)


def maps_fuse_file(mv: memoryview) -> bool:
    """True when any byte of the writable buffer ``mv`` lies in a mapping of a FUSE file (or
    its address cannot be told, or lies outside every mapping: then it is treated as one)."""
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError):
        return True
    try:
        for _, _, dev, hole in _covering(start, start + max(len(mv), 1)):
            if hole or (dev >= 0 and _is_fuse(dev)):
                return True
    except OSError:
        return True
    return False
