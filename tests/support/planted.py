"""What a past tenant could leave in a directory of the daemon's (planted here by root, as the
tenant did when it owned its grants directory): a tree deeper than Python's recursion limit,
symlinks pointing out of it, a fifo."""
from __future__ import annotations

import os
from pathlib import Path

DEPTH = 1600        # past sys.getrecursionlimit() (1000): a recursive walk dies here


def plant(where: Path, depth: int = DEPTH, outside: Path | None = None) -> Path:
    """Fill ``where`` (created if missing): a ``depth``-level chain of directories with a file at
    the bottom, a symlink to an outside directory at the top and at the bottom, a fifo, a
    dangling symlink. Returns the outside directory the symlinks point to (with a file in it),
    which must survive whatever removes ``where`` (``outside``, or one beside ``where``)."""
    where.mkdir(parents=True, exist_ok=True)
    outside = outside or where.parent / f".{where.name}-outside"
    outside.mkdir(exist_ok=True)
    (outside / "precious").write_bytes(b"keep me")
    os.symlink(outside, where / "out")
    os.mkfifo(where / "fifo")
    os.symlink("/nonexistent", where / "dangling")
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.symlink(str(outside), "out", dir_fd=fd)
        f = os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(f, b"x" * 4096)
        os.close(f)
    finally:
        os.close(fd)
    return outside
