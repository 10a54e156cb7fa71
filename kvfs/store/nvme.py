"""The local NVMe tier: one file per object in a directory on a local filesystem.

Objects are written with O_DIRECT through a page-aligned bounce buffer where the
filesystem allows it (otherwise buffered), fsynced, and renamed into place before
the store records them in the index. Reads use O_DIRECT into aligned buffers, so
they cost a real disk read and never pollute the page cache.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import AsyncIterator

import trio

from kvfs.errors import NoSuchObject, TierFull
from kvfs.store.tier import ObjectInfo, Tier

log = logging.getLogger(__name__)

ALIGN = 4096
_BOUNCE = 4 << 20


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class _Buffers(threading.local):
    """Per-thread page-aligned buffers (mmap), reused: first touch of fresh memory is slow."""

    def get(self, size: int) -> mmap.mmap:
        size = _round_up(max(size, ALIGN))
        buf = getattr(self, "buf", None)
        if buf is None or len(buf) < size:
            buf = self.buf = mmap.mmap(-1, size)
        return buf


class NvmeTier(Tier):
    name = "nvme"
    volatile = False

    def __init__(self, capacity: int, root: str | Path, *, threads: int = 4):
        super().__init__(capacity)
        self.root = Path(root)
        self.objdir = self.root / "objects"
        self.staging_dir = self.root / "staging"
        self.direct = False
        self._limiter = trio.CapacityLimiter(threads)
        self._bufs = _Buffers()

    def footprint(self, size: int) -> int:
        return _round_up(size)

    def path(self, oid: int) -> Path:
        h = f"{oid:016x}"
        return self.objdir / h[-2:] / h

    async def open(self) -> None:
        def prepare() -> bool:
            self.objdir.mkdir(parents=True, exist_ok=True)
            for i in range(256):
                (self.objdir / f"{i:02x}").mkdir(exist_ok=True)
            self.staging_dir.mkdir(exist_ok=True)
            for p in self.staging_dir.iterdir():     # leftovers of a crashed writer
                p.unlink()
            probe = self.root / ".direct-probe"
            try:
                fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            except OSError:
                return False
            try:
                buf = mmap.mmap(-1, ALIGN)
                os.pwrite(fd, buf, 0)
                return True
            except OSError:
                return False
            finally:
                os.close(fd)
                probe.unlink()
        self.direct = await trio.to_thread.run_sync(prepare)
        log.info("nvme tier at %s: %s I/O", self.root, "O_DIRECT" if self.direct else "buffered")

    def _write_file(self, info: ObjectInfo, data: memoryview) -> None:
        final = self.path(info.oid)
        tmp = final.with_suffix(".tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = os.open(tmp, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        try:
            if self.direct:
                bounce = self._bufs.get(_BOUNCE)
                off = 0
                while off < info.size:
                    n = min(_BOUNCE, info.size - off)
                    bounce[:n] = data[off:off + n]
                    wlen = _round_up(n)
                    if wlen > n:
                        bounce[n:wlen] = bytes(wlen - n)
                    os.pwrite(fd, memoryview(bounce)[:wlen], off)
                    off += n
                os.ftruncate(fd, info.size)
            else:
                off = 0
                while off < info.size:
                    off += os.pwrite(fd, data[off:off + _BOUNCE], off)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.rename(tmp, final)
        dfd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    async def put(self, info: ObjectInfo, data: memoryview) -> bytes:
        need = self.footprint(info.size)
        if need > self.free():
            raise TierFull(f"nvme tier: {info.size} bytes do not fit")
        self.used += need
        try:
            await trio.to_thread.run_sync(self._write_file, info, data, limiter=self._limiter)
        except OSError as e:
            self.used -= need
            if e.errno == errno.ENOSPC:
                raise TierFull(f"nvme tier: disk full ({e})") from None
            raise
        except BaseException:
            self.used -= need
            raise
        self.objects += 1
        return b""

    def _read_file(self, oid: int, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self.path(oid), os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            raise NoSuchObject(f"nvme tier has no object {oid:x}") from None
        try:
            if not self.direct:
                return os.pread(fd, length, offset)
            start = offset - offset % ALIGN
            span = _round_up(offset + length) - start
            buf = self._bufs.get(span)
            n = os.preadv(fd, [memoryview(buf)[:span]], start)
            lo = offset - start
            return bytes(memoryview(buf)[lo:max(lo, min(n, lo + length))])
        finally:
            os.close(fd)

    async def read(self, oid: int, loc: bytes, offset: int, length: int) -> memoryview:
        data = await trio.to_thread.run_sync(self._read_file, oid, offset, length, limiter=self._limiter)
        return memoryview(data)

    async def delete(self, oid: int, loc: bytes) -> None:
        p = self.path(oid)
        def rm() -> int:
            try:
                size = p.stat().st_size
                p.unlink()
                return size
            except FileNotFoundError:
                return -1
        size = await trio.to_thread.run_sync(rm, limiter=self._limiter)
        if size >= 0:
            self.used -= self.footprint(size)
            self.objects -= 1

    async def scan(self) -> AsyncIterator[tuple[int, bytes, int]]:
        def listing() -> list[tuple[int, bytes, int]]:
            out = []
            for shard in sorted(self.objdir.iterdir()):
                if not shard.is_dir():
                    continue
                with os.scandir(shard) as it:
                    for e in it:
                        if e.name.endswith(".tmp"):
                            continue
                        try:
                            out.append((int(e.name, 16), b"", e.stat().st_size))
                        except ValueError:
                            continue
            return out
        for row in await trio.to_thread.run_sync(listing):
            yield row

    def backing(self, oid: int, loc: bytes) -> dict | None:
        return {"path": str(self.path(oid)), "offset": 0, "direct": self.direct}
