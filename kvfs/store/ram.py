"""The RAM tier: objects as files in shared memory (tmpfs), mapped into the daemon.

Living in /dev/shm lets the GPU loader map a sealed object directly (the fast
path beside FUSE). Write staging buffers live here too and count against the
same byte budget, so sealing into RAM is a rename, not a copy.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import shutil
from pathlib import Path
from typing import AsyncIterator

import trio

from kvfs.errors import NoSuchObject, TierFull
from kvfs.store.tier import ObjectInfo, Tier

log = logging.getLogger(__name__)

MAPPED_MIN = 1 << 20      # objects at least this big stay tmpfs files (mapped; fast path)


def filesystem_of(path: str | Path) -> tuple[str, str, dict[str, str]]:
    """``(mount point, filesystem type, super options)`` of the mount holding ``path`` (an
    existing path), from /proc/self/mountinfo: the longest mount point above it."""
    real = os.path.realpath(path)
    best = ("", "", {})
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            mnt = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[0]):
                opts = dict(o.partition("=")[::2] for o in tail[2].split(","))
                best = (mnt, tail[0], opts)
    return best


class RamTier(Tier):
    name = "ram"
    volatile = True

    def __init__(self, capacity: int, shm_dir: str | Path, instance_id: str):
        super().__init__(capacity)
        self.dir = Path(shm_dir) / f"kvfs-{instance_id}"
        self.staging_dir = self.dir / "staging"
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}
        self.staged = 0                      # bytes held by write buffers (part of used)
        self._seq = itertools.count()

    def _path(self, oid: int) -> str:
        return f"{self.dir}/{oid:016x}"

    async def open(self) -> None:
        # whatever a crashed daemon left here is volatile and gone by definition
        shutil.rmtree(self.dir, ignore_errors=True)
        self.staging_dir.mkdir(parents=True)

    async def close(self) -> None:
        self._maps.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _install(self, oid: int, fd: int, size: int) -> None:
        if size < MAPPED_MIN:
            # small objects live in the daemon's memory: Python's mmap keeps a descriptor
            # per mapping, and 100k small files would exhaust the descriptor limit
            buf = os.pread(fd, size, 0)
            os.unlink(self._path(oid))
            self._maps[oid] = (buf, size)
        else:
            self._maps[oid] = (mmap.mmap(fd, size, prot=mmap.PROT_READ), size)
        self.objects += 1

    async def put(self, info: ObjectInfo, data: memoryview) -> bytes:
        if info.size > self.free():
            raise TierFull(f"ram tier: {info.size} bytes do not fit")
        self.used += info.size
        try:
            path = self._path(info.oid)

            def write() -> int:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, info.size)
                with mmap.mmap(fd, info.size) as mm:
                    mm[:] = data
                return fd
            fd = await trio.to_thread.run_sync(write)
            try:
                self._install(info.oid, fd, info.size)
            finally:
                os.close(fd)
        except BaseException:
            self.used -= info.size
            raise
        return b""

    def adopt(self, info: ObjectInfo, staging: "Staging") -> bytes:
        """Turn a RAM staging buffer into the object itself (no copy)."""
        assert not staging.spilled and staging.size == info.size
        os.rename(staging.path, self._path(info.oid))
        self._install(info.oid, staging.fd, info.size)
        # the staged bytes become object bytes: used stays, staged drops
        self.staged -= staging.size
        staging.detach()
        return b""

    async def read(self, oid: int, loc: bytes, offset: int, length: int) -> memoryview:
        try:
            mm, size = self._maps[oid]
        except KeyError:
            raise NoSuchObject(f"ram tier has no object {oid:x}") from None
        return memoryview(mm)[offset:min(size, offset + length)]

    def view(self, oid: int) -> memoryview | None:
        entry = self._maps.get(oid)
        return memoryview(entry[0]) if entry else None

    async def delete(self, oid: int, loc: bytes) -> None:
        entry = self._maps.pop(oid, None)
        if entry is None:
            return
        self.used -= entry[1]
        self.objects -= 1
        try:
            os.unlink(self._path(oid))
        except FileNotFoundError:
            pass
        # the mapping is released when the last memoryview over it goes away

    async def scan(self) -> AsyncIterator[tuple[int, bytes, int]]:
        for oid, (_, size) in list(self._maps.items()):
            yield oid, b"", size

    def backing(self, oid: int, loc: bytes) -> dict | None:
        entry = self._maps.get(oid)
        if entry is None or not isinstance(entry[0], mmap.mmap):
            return None
        return {"path": self._path(oid), "offset": 0, "direct": False}

    def new_staging(self) -> "Staging":
        return Staging(self, self.staging_dir / f"w{next(self._seq):x}")


class Staging:
    """A growable write buffer: a tmpfs file, or a file on NVMe once spilled."""

    def __init__(self, ram: RamTier, path: Path):
        self.ram = ram
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.size = 0
        self.spilled = False
        self._spilling: trio.Event | None = None    # set while spill copies: changes wait

    def _account(self, new_size: int) -> None:
        if not self.spilled:
            delta = new_size - self.size
            self.ram.used += delta
            self.ram.staged += delta
        self.size = new_size

    async def write(self, offset: int, data) -> int:
        while self._spilling is not None:          # the copy would miss this write
            await self._spilling.wait()
        end = offset + len(data)
        if self.spilled:
            n = await trio.to_thread.run_sync(os.pwrite, self.fd, data, offset)
        else:
            n = os.pwrite(self.fd, data, offset)   # tmpfs: a memory copy
        if end > self.size:
            self._account(end)
        return n

    async def read(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        if self.spilled:
            return await trio.to_thread.run_sync(os.pread, self.fd, length, offset)
        return os.pread(self.fd, length, offset)

    async def truncate(self, size: int) -> None:
        while self._spilling is not None:
            await self._spilling.wait()
        if self.spilled:
            await trio.to_thread.run_sync(os.ftruncate, self.fd, size)
        else:
            os.ftruncate(self.fd, size)
        self._account(size)

    async def fill_from(self, data: memoryview) -> None:
        """Initialise with existing content (opening a sealed file for writing)."""
        await self.truncate(len(data))
        if len(data):
            await trio.to_thread.run_sync(os.pwrite, self.fd, data, 0)

    async def spill(self, to_dir: Path) -> None:
        """Move the bytes to a file under ``to_dir`` (RAM is full), in a thread. Concurrent
        writes (one handle's O_DIRECT writes arrive as parallel requests) wait for it; a
        second spill of the same buffer waits for the first."""
        while self._spilling is not None:
            await self._spilling.wait()
        if self.spilled or self.fd < 0:
            return
        dst = to_dir / self.path.name
        size = self.size
        def copy() -> int:
            fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                off = 0
                while off < size:
                    buf = os.pread(self.fd, min(4 << 20, size - off), off)
                    os.pwrite(fd, buf, off)
                    off += len(buf)
            except BaseException:
                os.close(fd)
                dst.unlink(missing_ok=True)
                raise
            return fd
        done = self._spilling = trio.Event()
        try:
            fd = await trio.to_thread.run_sync(copy)
        finally:
            self._spilling = None
            done.set()
        if self.fd < 0:                            # discarded meanwhile
            os.close(fd)
            dst.unlink(missing_ok=True)
            return
        old_fd, old_path = self.fd, self.path
        self.fd, self.path = fd, dst
        self.ram.used -= self.size
        self.ram.staged -= self.size
        self.spilled = True
        os.close(old_fd)
        os.unlink(old_path)
        log.debug("spilled write buffer %s (%d bytes) to %s", old_path.name, self.size, to_dir)

    def map(self) -> mmap.mmap | None:
        return mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ) if self.size else None

    def detach(self) -> None:
        """Forget the file without deleting it (it was adopted as an object)."""
        os.close(self.fd)
        self.fd = -1
        self.size = 0

    def discard(self) -> None:
        if self.fd < 0:
            return
        if not self.spilled:
            self.ram.used -= self.size
            self.ram.staged -= self.size
        os.close(self.fd)
        self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
