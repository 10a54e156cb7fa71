"""Files through a mount: content derived from seeds, reads, the runtime's write pattern,
errnos, xattrs, and the syscalls Python lacks (renameat2, fallocate)."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import random
from pathlib import Path

MiB = 1 << 20


def content(seed: str, size: int) -> bytes:
    """Deterministic bytes of ``size`` derived from ``seed``."""
    return random.Random(seed).randbytes(size)


def read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def xattr(path, name: str) -> str:
    return os.getxattr(path, name).decode()


def errno_of(fn, *args, **kwargs) -> int | None:
    """Run ``fn``; return the errno of the OSError it raised, or None if it succeeded."""
    try:
        fn(*args, **kwargs)
    except OSError as e:
        return e.errno
    return None


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1


def renameat2(old, new, flags: int) -> None:
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 not in libc")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) itself, not glibc's posix_fallocate (which emulates it on EOPNOTSUPP)."""
    fn = _libc.fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fn(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def put(path: Path, data: bytes) -> None:
    """The runtime pattern: write ``name.tmp`` then ``os.replace`` over the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def tier_of(path: Path) -> str | None:
    """The tier a file of a mount lives on (``user.kvfs.tier``), or None if it cannot be read."""
    try:
        return os.getxattr(path, "user.kvfs.tier").decode()
    except OSError:
        return None


def direct_read(path: Path, buf) -> bytes:
    """The whole file read with O_DIRECT (past the kernel's page cache) into ``buf``, an
    aligned buffer (``mmap.mmap(-1, size)``) at least as large as the file."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return bytes(buf[:os.preadv(fd, [buf], 0)])
    finally:
        os.close(fd)
