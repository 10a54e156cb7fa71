"""A sealed object's tier file opened for the kernel to read it (FUSE passthrough,
kvfs/fs/passthrough.py).

Only a file the daemon made in its own directories is ever given: the RAM tier's mapped file
(in its 0700 tmpfs directory) or the NVMe tier's object file, found by the tier's own
``backing`` answer and opened with ``O_NOFOLLOW``. A RAM copy was written by the daemon or
verified when it was promoted; an NVMe copy is read back in full and checked against the
object's chunk checksums before it is given (once per registration: the kernel then reads
the pages this check brought in). A copy that fails is not given (the daemon's own read path
then finds the failure and handles it: EIO, the object dropped), nor one on a tier without
files (remote), nor a small object the RAM tier keeps in the daemon's memory.
"""
from __future__ import annotations

import functools
import logging
import os
import threading

import trio

from kvfs.store import checksum

log = logging.getLogger(__name__)


def _open_verified(path: str, size: int, chunk_size: int, sums: tuple[int, ...],
                   abandoned: threading.Event) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        log.warning("not handing %s to the kernel: %s", path, e)
        return None
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError("size differs")
        data = os.pread(fd, size, 0) if size else b""
        if len(data) != size or checksum.chunk_sums(memoryview(data), chunk_size) != tuple(sums):
            raise ValueError("checksum mismatch")
    except (OSError, ValueError) as e:
        os.close(fd)
        log.warning("not handing %s to the kernel: %s", path, e)
        return None
    if abandoned.is_set():          # the opener gave up at read_deadline: nobody takes the fd
        os.close(fd)
        return None
    return fd


async def _verified_within_deadline(store, tier, path: str, obj) -> int | None:
    """The NVMe copy opened and checked in a worker thread, abandoned at the store's
    ``read_deadline`` (a hung disk): counted as a missed deadline, and the open goes on without
    passthrough (the daemon's read then fails with EIO at its own deadline, as before)."""
    abandoned = threading.Event()
    check = functools.partial(_open_verified, path, obj.size, obj.chunk_size, obj.sums, abandoned)
    if not store.reads.deadline:
        return await trio.to_thread.run_sync(check)
    with trio.move_on_after(store.reads.deadline):
        return await trio.to_thread.run_sync(check, abandon_on_cancel=True)
    abandoned.set()
    store.telemetry.deadline(tier.name)
    log.warning("checking %s for passthrough passed the %.1f s read deadline", path, store.reads.deadline)
    return None


async def open_backing(store, obj) -> tuple[int, str] | None:
    """A read-only descriptor of ``obj``'s top tier file for the kernel and that tier's
    name, or None."""
    if obj.corrupt or obj.dead or obj.busy:
        return None
    for tier in store.tiers:
        loc = obj.place.get(tier.name)
        if loc is None:
            continue
        where = tier.backing(obj.oid, loc) if tier.available else None
        if where is None or where.get("offset", 0) != 0:
            return None
        if tier is store.ram:
            try:
                fd = os.open(where["path"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as e:
                log.debug("RAM copy of %x: %s", obj.oid, e)
                return None
            if os.fstat(fd).st_size != obj.size:
                os.close(fd)
                return None
            return fd, tier.name
        fd = await _verified_within_deadline(store, tier, where["path"], obj)
        return None if fd is None else (fd, tier.name)
    return None
