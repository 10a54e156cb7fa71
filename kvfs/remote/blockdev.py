"""The kernel transport: a block device (``nvme connect`` → /dev/nvmeXnY, a loop device) or a file.

Aligned O_DIRECT I/O (falling back to buffered I/O + fdatasync where the file
system refuses O_DIRECT) in worker threads behind a CapacityLimiter, so the
trio thread never blocks. Buffers are anonymous mmaps (page-aligned).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import struct

import trio

from kvfs.errors import ConfigError, TierUnavailable
from kvfs.protocol import ALIGN as _ALIGN
from kvfs.remote.volume import Volume

log = logging.getLogger(__name__)

_BLKGETSIZE64 = 0x80081272
_BLKSSZGET = 0x1268


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class FileVolume(Volume):
    describe = "blockdev"

    def __init__(self, path: str, *, create_size: int = 0, threads: int = 4, read_only: bool = False):
        super().__init__()
        self.path = path
        self.create_size = create_size
        self.read_only = read_only          # opened O_RDONLY: any write fails (kvfs remote status)
        self.fd = -1
        self.direct = False
        self.is_blockdev = False
        self._limiter = trio.CapacityLimiter(threads)

    @property
    def available(self) -> bool:
        return self.fd >= 0

    def _open_sync(self) -> None:
        path = self.path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not self.create_size:
                raise ConfigError(f"remote volume {path} does not exist (give --remote-size to create a file)") from None
            with open(path, "ab") as f:
                f.truncate(_round_up(self.create_size, _ALIGN))
            st = os.stat(path)
        self.is_blockdev = stat.S_ISBLK(st.st_mode)
        if not (self.is_blockdev or stat.S_ISREG(st.st_mode)):
            raise ConfigError(f"remote volume {path} is neither a block device nor a regular file")
        flags = (os.O_RDONLY if self.read_only else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags | os.O_DIRECT)
            self.direct = True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise ConfigError(f"cannot open remote volume {path}: {e.strerror}") from None
            fd = os.open(path, flags)
            self.direct = False
        if self.is_blockdev:
            size = struct.unpack("Q", fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8))[0]
            lbs = struct.unpack("i", fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4))[0]
        else:
            size, lbs = os.fstat(fd).st_size, 512
        if self.direct and not self.is_blockdev:
            # probe: some file systems accept O_DIRECT at open but fail the I/O
            buf = mmap.mmap(-1, _ALIGN)
            try:
                os.preadv(fd, [buf], 0)
            except OSError:
                os.close(fd)
                fd = os.open(path, flags)
                self.direct = False
        self.fd = fd
        self.block_size = max(lbs, 512)
        self.size = size // _ALIGN * _ALIGN

    async def open(self) -> None:
        await trio.to_thread.run_sync(self._open_sync, limiter=self._limiter)
        log.info("remote volume %s: %s, %d bytes, %d-byte blocks, %s", self.path,
                 "block device" if self.is_blockdev else "file", self.size, self.block_size,
                 "O_DIRECT" if self.direct else "buffered")

    async def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            await trio.to_thread.run_sync(os.fsync, fd, limiter=self._limiter)
            os.close(fd)

    def buffer(self, size: int):
        return mmap.mmap(-1, _round_up(max(size, 1), _ALIGN))

    def _fd(self) -> int:
        if self.fd < 0:
            raise TierUnavailable(f"remote volume {self.path} is closed")
        return self.fd

    async def read(self, offset: int, length: int) -> memoryview:
        fd = self._fd()

        def run() -> memoryview:
            buf = mmap.mmap(-1, _round_up(max(length, 1), _ALIGN))
            view = memoryview(buf)
            pos = 0
            while pos < length:
                n = os.preadv(fd, [view[pos:_round_up(length, _ALIGN)]], offset + pos)
                if n <= 0:
                    raise OSError(errno.EIO, f"short read at {offset + pos}")
                pos += n
            return view[:length]
        try:
            return await trio.to_thread.run_sync(run, limiter=self._limiter)
        except OSError as e:
            self.errors += 1
            self.last_error = str(e)
            raise TierUnavailable(f"remote volume {self.path}: read failed: {e}") from e

    async def _write(self, offset: int, data: memoryview) -> None:
        fd = self._fd()
        n = len(data)
        if self.direct and not isinstance(data.obj, mmap.mmap):
            buf = self.buffer(n)
            buf[:n] = data
            data = memoryview(buf)[:n]

        def run() -> None:
            pos = 0
            while pos < n:
                k = os.pwritev(fd, [data[pos:]], offset + pos)
                if k <= 0:
                    raise OSError(errno.EIO, f"short write at {offset + pos}")
                pos += k
        try:
            await trio.to_thread.run_sync(run, limiter=self._limiter)
        except OSError as e:
            self.errors += 1
            self.last_error = str(e)
            raise TierUnavailable(f"remote volume {self.path}: write failed: {e}") from e

    async def _flush(self) -> None:
        fd = self._fd()
        try:
            await trio.to_thread.run_sync(os.fdatasync, fd, limiter=self._limiter)
        except OSError as e:
            self.errors += 1
            raise TierUnavailable(f"remote volume {self.path}: flush failed: {e}") from e

    def status(self) -> dict:
        st = super().status()
        st.update({"path": self.path, "direct": self.direct, "block_device": self.is_blockdev})
        return st

    def identity(self) -> dict:
        d = super().identity()
        d.update({"path": self.path, "direct": self.direct, "block_device": self.is_blockdev})
        return d
