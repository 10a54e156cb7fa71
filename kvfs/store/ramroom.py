"""Room on the RAM tier's filesystem, beside the tier's own accounting.

The RAM tier counts the bytes it placed (``used`` against ``capacity``), but its tmpfs can be
fuller than that: a shared ``/dev/shm`` holds other processes' files, and anything the
accounting does not know of takes pages (a file a grantee kept open). A write must not fail,
nor leave a half-written buffer, because of that while a lower tier has room. So:

- a write buffer about to take tmpfs pages (it reaches ``mapped_min``, see
  kvfs.store.staging.Staging) first checks the filesystem's free space (``fstatvfs``) and, short of
  room for it plus RESERVE, spills to NVMe instead (the tier below's staging directory, the one
  the RAM-over-budget spill uses);
- a tmpfs write that fails for want of room anyway (ENOSPC, or a short write) spills the
  buffer and writes there: the caller sees a whole write, never the error;
- an object put into RAM (a promotion) is written with ``pwrite`` after the same check, never
  through a mapping (a write to a mapped tmpfs page the filesystem cannot back is a SIGBUS
  that kills the daemon); ENOSPC there is TierFull (the object stays where it was).

``.kvfs/stats`` shows ``tiers.ram.fs_spills`` (buffers spilled because the filesystem, not the
budget, was full) and ``tiers.ram.fs_free`` (the filesystem's free bytes, beside the books).
"""
from __future__ import annotations

import errno
import logging
import os

import trio

from kvfs.errors import TierFull
from kvfs.store import safedir

log = logging.getLogger(__name__)

RESERVE = 16 << 20      # free bytes kept on the RAM tier's filesystem (name table, small files)


def fs_free(dir_fd: int) -> int:
    """Bytes an unprivileged writer may still put on the filesystem of ``dir_fd``."""
    st = os.fstatvfs(dir_fd)
    return st.f_bavail * st.f_frsize


def has_room(ram, size: int) -> bool:
    """Whether the RAM tier's filesystem can take ``size`` more bytes and keep RESERVE."""
    home = ram.home
    if home is None:
        return True
    try:
        return fs_free(home.fd) >= size + RESERVE
    except OSError:
        return True             # the write itself will tell


def status(ram) -> dict:
    """``fs_spills``, and ``fs_free``: the bytes free on the tier's filesystem, beside its books
    (``capacity - used``): less than that means something else holds the tmpfs's pages."""
    try:
        free = fs_free(ram.home.fd) if ram.home is not None else None
    except OSError:
        free = None
    return {"fs_spills": getattr(ram, "fs_spills", 0), "fs_free": free}


async def spill(staging, why: str) -> None:
    """Move the buffer to the tier below's staging directory (``ram.overflow``)."""
    ram = staging.ram
    to = getattr(ram, "overflow", None)
    if to is None:
        raise TierFull(f"the RAM tier's filesystem is full ({why}) and no tier below takes write buffers")
    ram.fs_spills = getattr(ram, "fs_spills", 0) + 1
    if ram.fs_spills == 1 or ram.fs_spills % 1000 == 0:
        log.warning("the RAM tier's filesystem is full (%s; %d write buffers spilled so far, %d bytes "
                    "on its books): writes go to %s", why, ram.fs_spills, ram.used, to.path)
    await staging.spill(to)


async def to_file(staging, end: int) -> None:
    """``staging.to_file()`` (a buffer reaching ``end`` bytes leaves the daemon's memory for
    a tmpfs file), or a spill when the filesystem has no room for it."""
    if not has_room(staging.ram, end):
        return await spill(staging, "no room for the buffer")
    try:
        staging.to_file()
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        await spill(staging, str(e))


async def write(staging, offset: int, data, n: int, threaded: bool = False) -> int:
    """pwrite ``data`` (``n`` bytes) at ``offset`` into the buffer's file: its tmpfs file (a
    memory copy, in this thread unless ``threaded``) unless spilled; a tmpfs without room
    spills it first."""
    if not staging.spilled:
        try:
            if threaded:
                got = await trio.to_thread.run_sync(os.pwrite, staging.fd, data, offset)
            else:
                got = os.pwrite(staging.fd, data, offset)
            if got == n:
                return got
            why = f"short write ({got} of {n} bytes)"
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            why = str(e)
        await spill(staging, why)
    return await trio.to_thread.run_sync(pwrite_all, staging.fd, data, offset, n)


def pwrite_all(fd: int, data, offset: int, n: int) -> int:
    """All ``n`` bytes or an error (a short write on a full disk would leave the buffer
    shorter than its accounted size)."""
    view, done = memoryview(data).cast("B"), 0
    while done < n:
        got = os.pwrite(fd, view[done:], offset + done)
        if got <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += got
    return n


def put_file(home: int, name: str, data) -> int:
    """A new object file ``name`` in ``home`` holding ``data`` (worker thread): its descriptor.
    TierFull when the filesystem has no room (nothing is left behind)."""
    data = memoryview(data).cast("B")
    size = data.nbytes
    if fs_free(home) < size + RESERVE:
        raise TierFull(f"ram tier: its filesystem has no room for {size} bytes")
    fd = safedir.create_file(home, name)
    try:
        os.ftruncate(fd, size)          # huge pages: the size is known before the pages come
        done = 0
        while done < size:
            n = os.pwrite(fd, data[done:], done)
            if n <= 0:
                raise OSError(errno.ENOSPC, "no progress writing the object")
            done += n
    except BaseException as e:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=home)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise TierFull(f"ram tier: its filesystem is full ({e})") from None
        raise
    return fd
