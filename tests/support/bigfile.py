"""Big files for the tests of issue 34 (1): write and check a file of any size through a
mount a MiB at a time, without holding it in memory (each MiB differs: its index leads it)."""
from __future__ import annotations

import os
import random
import struct
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
_BASE = random.Random("kvfs-bigfile").randbytes(MiB)


def piece(seed: int, i: int) -> bytes:
    """MiB number ``i`` of the big file of ``seed``."""
    return struct.pack("<QQ", seed, i) + _BASE[16:]


def write_big(path: Path, size: int, seed: int = 0, rename: bool = True) -> None:
    """The runtime pattern at scale: ``name.tmp`` written a MiB at a time, then renamed
    (``rename=False``: written in place)."""
    tmp = path.with_name(path.name + ".tmp") if rename else path
    with open(tmp, "wb") as f:
        for i in range(size // MiB):
            f.write(piece(seed, i))
    if rename:
        os.replace(tmp, path)


def check_big(path: Path, size: int, seed: int = 0) -> str | None:
    """None when ``path`` holds exactly the big file of ``seed``; else what differs. The
    kernel's cached pages of the file are dropped first, so the bytes come from the daemon."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != size:
            return f"size {os.fstat(fd).st_size}, want {size}"
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for i in range(size // MiB):
            got = os.pread(fd, MiB, i * MiB)
            if got != piece(seed, i):
                return f"MiB {i} differs ({len(got)} bytes read)"
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return None
