"""A file's write buffer (:class:`Staging`) and reading a buffer or an object file without a
mapping that could fault.

A buffer lives in the daemon's memory while it is smaller than the RAM tier's ``mapped_min``,
then in a tmpfs file of the tier's ``staging/`` directory, or in a file on NVMe once spilled;
its bytes count against the RAM tier's budget (kvfs/store/ram.py, which makes and recycles the
files). A tmpfs file is mapped only once every page of it was allocated (``fallocate``: ENOSPC,
never SIGBUS); a spilled one is read with ``pread`` into private memory (:func:`read_private`,
:class:`FileSource`, :func:`sum_file`). docs/design.md, "Mappings the daemon makes".
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
from pathlib import Path

import trio

from kvfs.store import ramroom, safedir
from kvfs.store.safedir import Dir

log = logging.getLogger(__name__)


def unlink_quiet(where: Dir, name: str) -> None:
    try:
        os.unlink(name, dir_fd=where.fd)
    except OSError:
        pass


class Staging:
    """A growable write buffer: bytes in the daemon's memory while it is smaller than the
    tier's ``mapped_min`` (what a small object becomes at seal anyway: no file, no syscall),
    then a tmpfs file (what a mapped object becomes), or a file on NVMe once spilled."""

    def __init__(self, ram, where: Dir | None, name: str):
        self.ram = ram
        self.dir = where                # the directory holding the buffer's file (by descriptor)
        self.name = name
        self.fd = -1                    # the file, once there is one
        self.mem: bytes | bytearray | None = b""    # the bytes while in memory (None: a file)
        self.size = 0
        self.spilled = False
        self._spilling: trio.Event | None = None    # set while spill copies: changes wait
        self.backed = False             # its tmpfs file has every page allocated (see back)

    @property
    def path(self) -> Path:
        return self.dir.path / self.name

    def _gone(self) -> bool:
        return self.mem is None and self.fd < 0

    def account(self, new_size: int) -> None:
        self.backed = False             # it may have holes now (see back)
        if not self.spilled:
            delta = new_size - self.size
            self.ram.used += delta
            self.ram.staged += delta
        self.size = new_size

    def to_file(self, oid: int | None = None) -> None:
        """The buffer reaches ``mapped_min``: its bytes move to a tmpfs file (``oid``: one
        already named as that object, :meth:`RamTier.object_file`)."""
        where, name, fd = self.ram.staging_file() if oid is None else self.ram.object_file(oid)
        try:
            if self.size:
                ramroom.pwrite_all(fd, self.mem, 0, self.size)
        except BaseException:
            os.close(fd)
            unlink_quiet(where, name)
            raise
        self.dir, self.name, self.fd, self.mem = where, name, fd, None

    def _mem_write(self, offset: int, data, end: int) -> None:
        mem = self.mem
        if offset == 0 and end >= len(mem) and type(data) is bytes:
            self.mem = data             # the whole buffer (a file's one write): kept, no copy
            return
        if type(mem) is not bytearray:
            mem = self.mem = bytearray(mem)
        if offset > len(mem):
            mem.extend(bytes(offset - len(mem)))
        mem[offset:end] = data

    async def write(self, offset: int, data) -> int:
        while self._spilling is not None:          # the copy would miss this write
            await self._spilling.wait()
        n = len(data) if type(data) is bytes else memoryview(data).nbytes
        end = offset + n
        if self.mem is not None:
            if end < self.ram.mapped_min:
                self._mem_write(offset, data, end)
                if end > self.size:
                    self.account(end)
                return n
            if not await self._grow(end):           # past the budget: spilled before it grows
                await ramroom.to_file(self, end)    # or spilled: no room on the tmpfs
        elif end > self.size:
            await self._grow(end)
        n = await ramroom.write(self, offset, data, n)     # a full tmpfs spills (kvfs.store.ramroom)
        if end > self.size:
            self.account(end)
        return n

    async def read(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        mem = self.mem
        if mem is not None:
            if type(mem) is bytes:
                return mem[offset:offset + length]
            return bytes(memoryview(mem)[offset:offset + length])    # a copy: the buffer may change
        if self.spilled:
            # its own descriptor: a seal may discard (close) the buffer while the thread reads
            fd = os.dup(self.fd)
            try:
                return await trio.to_thread.run_sync(os.pread, fd, length, offset)
            finally:
                os.close(fd)
        return os.pread(self.fd, length, offset)

    async def truncate(self, size: int) -> None:
        while self._spilling is not None:
            await self._spilling.wait()
        if self.mem is not None:
            if size < self.ram.mapped_min:
                mem = self.mem
                if size < len(mem):
                    self.mem = mem[:size]
                elif size > len(mem):
                    self.mem = bytes(mem) + bytes(size - len(mem))
                self.account(size)
                return
            if not await self._grow(size):
                await ramroom.to_file(self, size)   # as a write: no room on the tmpfs spills
        elif size > self.size and not await self._grow(size) and not ramroom.has_room(self.ram, size - self.size):
            await ramroom.spill(self, "no room to grow the buffer")
        if self.spilled:
            await trio.to_thread.run_sync(os.ftruncate, self.fd, size)
        else:
            os.ftruncate(self.fd, size)
        self.account(size)

    async def fill_from(self, data: memoryview) -> None:
        """Initialise with existing content (opening a sealed file for writing)."""
        if self.mem is not None and len(data) < self.ram.mapped_min:
            self.mem = bytes(data)
            self.account(len(data))
            return
        n = len(data)
        if self.mem is not None and not await self._grow(n):
            await ramroom.to_file(self, n)
        await ramroom.write(self, 0, data, n, threaded=True)    # every byte written: no hole
        self.account(n)

    async def _grow(self, end: int) -> bool:
        """Before the buffer grows to ``end`` bytes (a write or a truncate up): a buffer in RAM
        that would take the tier past its budget by a jump (a write at a far offset, a
        truncate up: more than a quarter of the tier at once) or that can never fit spills
        first, so the growth lands on NVMe (a sparse file there) instead of being copied
        there after. An ordinary piece grows in RAM: the mover demotes colder objects to make
        room (``FileHandles.written`` kicks it, and spills the buffer if it cannot keep up),
        so the newest blocks stay in the top tier. True if it spilled."""
        if self.spilled or self._gone():
            return False
        ram = self.ram
        growth = end - self.size
        if ram.used + growth <= ram.capacity or getattr(ram, "overflow", None) is None:
            return False
        if end <= ram.capacity and growth <= ram.capacity // 4:
            return False
        await self.spill(ram.overflow)
        return self.spilled

    async def back(self) -> None:
        """Every page of the buffer's tmpfs file allocated, before anything maps it (the seal
        hashes it through a mapping, and the object it becomes stays mapped): a write at a
        large offset or a truncate up leaves holes, and a fault on a hole of a full tmpfs is a
        SIGBUS that kills the daemon. ``fallocate`` fails cleanly instead (ENOSPC): the buffer
        then spills to NVMe (kvfs.store.ramroom), which the seal reads with ``pread``."""
        if self.spilled or self.mem is not None or self.fd < 0 or not self.size or self.backed:
            return
        size, fd = self.size, self.fd
        # the first hole or fallocated page (tmpfs reports both as holes): none is the common
        # case (bytes written in order), one lseek; else fallocate from there (cheap over pages
        # already there)
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
        try:
            if hole < size <= hole + (1 << 20):
                os.posix_fallocate(fd, hole, size - hole)
            elif hole < size:
                await trio.to_thread.run_sync(os.posix_fallocate, fd, hole, size - hole)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            await ramroom.spill(self, f"no room for its holes ({e.strerror})")
            return
        if self.size == size and self.fd == fd:
            self.backed = True

    def _back_now(self) -> None:
        """:meth:`back` without the spill (the mapping's own guard): ENOSPC, never a mapping
        over holes."""
        if self.backed:
            return
        hole = os.lseek(self.fd, 0, os.SEEK_HOLE)
        if hole < self.size:
            os.posix_fallocate(self.fd, hole, self.size - hole)
        self.backed = True

    def mapped(self) -> "_MappedView":
        """The buffer's bytes, read-only, while the block runs (writes must wait meanwhile):
        ``with staging.mapped() as view``. A tmpfs file is mapped only once :meth:`back` made
        its every page; a spilled buffer is read (``pread``) into private memory instead."""
        return _MappedView(self)

    async def spill(self, to_dir: Dir) -> None:
        """Move the bytes to a file under ``to_dir`` (RAM is full), in a thread. Concurrent
        writes (one handle's O_DIRECT writes arrive as parallel requests) wait for it; a
        second spill of the same buffer waits for the first."""
        while self._spilling is not None:
            await self._spilling.wait()
        if self.spilled or self._gone():
            return
        size, src, mem = self.size, self.fd, self.mem

        def copy() -> int:
            fd = safedir.create_file(to_dir.fd, self.name)
            try:
                if mem is not None:                # all of it or ENOSPC, never a short file
                    ramroom.pwrite_all(fd, mem, 0, size)
                off = 0
                while mem is None and off < size:
                    buf = os.pread(src, min(4 << 20, size - off), off)
                    if not buf:
                        raise OSError(errno.EIO, f"write buffer file ends at {off} of {size} bytes")
                    off += ramroom.pwrite_all(fd, buf, off, len(buf))
            except BaseException:
                os.close(fd)
                unlink_quiet(to_dir, self.name)
                raise
            return fd
        done = self._spilling = trio.Event()
        try:
            fd = await trio.to_thread.run_sync(copy)
        finally:
            self._spilling = None
            done.set()
        if self._gone():                           # discarded meanwhile
            os.close(fd)
            unlink_quiet(to_dir, self.name)
            return
        old_fd, old_dir = self.fd, self.dir
        self.fd, self.dir, self.mem = fd, to_dir, None
        self.ram.used -= self.size
        self.ram.staged -= self.size
        self.spilled = True
        if old_fd >= 0:
            os.close(old_fd)
            unlink_quiet(old_dir, self.name)
        log.debug("spilled write buffer %s (%d bytes) to %s", self.name, self.size, to_dir)

    def detach(self) -> None:
        """Forget the file without deleting it (it was adopted as an object)."""
        os.close(self.fd)
        self.fd = -1
        self.size = 0

    def discard(self) -> None:
        if self._gone():
            return
        if not self.spilled:
            self.ram.used -= self.size
            self.ram.staged -= self.size
        if self.mem is not None:
            self.mem, self.size = None, 0
            return
        if self.ram.can_recycle(self):
            try:
                self.ram.recycle(self)
                return
            except OSError:
                pass
        os.close(self.fd)
        self.fd = -1
        try:
            os.unlink(self.name, dir_fd=self.dir.fd)
        except OSError:
            pass


class _MappedView:
    """:meth:`Staging.mapped`: a view of the buffer's bytes (a class, not a generator: it is
    on every seal's path)."""

    __slots__ = ("staging", "view", "mm")

    def __init__(self, staging: Staging):
        self.staging, self.view, self.mm = staging, None, None

    def __enter__(self) -> memoryview:
        s = self.staging
        if s.mem is not None:
            self.view = memoryview(s.mem)
        elif s.size and s.spilled:
            self.mm = read_private(s.fd, s.size)
            self.view = memoryview(self.mm)[:s.size]
        elif s.size:
            s._back_now()           # every page allocated (else ENOSPC): a fault cannot need one
            self.mm = mmap.mmap(s.fd, s.size, prot=mmap.PROT_READ)
            self.view = memoryview(self.mm)
        else:
            self.view = memoryview(b"")
        return self.view

    def __exit__(self, *exc) -> None:
        self.view.release()
        if self.mm is not None:
            self.mm.close()


class FileSource:
    """The first ``size`` bytes of a file, sliced with ``pread`` (a spilled write buffer given
    to a tier's ``put``, Tier.puts_from_slices): its bytes are read piece by piece into the
    daemon's own memory, never mapped and never held whole."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise ValueError("FileSource slices are contiguous")
        want = max(0, stop - start)
        data = os.pread(self.fd, want, start)
        while len(data) < want:
            more = os.pread(self.fd, want - len(data), start + len(data))
            if not more:
                raise OSError(errno.EIO, f"write buffer file ends at {start + len(data)} of {self.size} bytes")
            data += more
        return data


def sum_file(fd: int, size: int, chunk_size: int) -> tuple[int, tuple[int, ...]]:
    """``checksum.summarize`` of the first ``size`` bytes of ``fd``, read with ``preadv`` in
    4 MiB pieces into one private buffer (worker thread). EIO if the file is shorter."""
    from kvfs.store.checksum import Summer
    summer = Summer(chunk_size, size)
    buf = mmap.mmap(-1, min(max(size, 1), 4 << 20))
    view = memoryview(buf)
    try:
        off = 0
        while off < size:
            n = os.preadv(fd, [view[:min(len(view), size - off)]], off)
            if n <= 0:
                raise OSError(errno.EIO, f"write buffer file ends at {off} of {size} bytes")
            summer.update(view[:n])
            off += n
    finally:
        view.release()
        buf.close()
    return summer.result()


def read_private(fd: int, size: int, summer=None) -> mmap.mmap:
    """The first ``size`` bytes of ``fd`` read (``preadv``) into private, page-aligned memory
    (an anonymous mapping: its pages are the process's own, never a file's), fed to ``summer``
    (checksum.Summer) piece by piece while in cache. EIO if the file is shorter."""
    mm = mmap.mmap(-1, max(size, 1))
    view = memoryview(mm)
    try:
        off = 0
        while off < size:
            n = os.preadv(fd, [view[off:min(size, off + (4 << 20))]], off)
            if n <= 0:
                raise OSError(errno.EIO, f"write buffer file ends at {off} of {size} bytes")
            if summer is not None:
                summer.update(view[off:off + n])
            off += n
    finally:
        view.release()
    return mm
