"""Reading block files: page-aligned buffers, full reads, and the fast path beside FUSE.

Fast path (daemon protocol): with the block open through the mount (the open fd is the
lease that keeps the backing bytes where they are), ``getxattr(fd, "user.kvfs.backing")``
returns ``{"tier", "path", "offset", "size", "checksum", "direct"}``. The loader reads
``size`` bytes at ``offset`` of ``path`` (O_DIRECT when ``direct``), checks xxh3_64 of them
against ``checksum`` and only then closes the mount fd. Any OSError on the xattr means no
fast path; the mount's own read path is the fallback. A checksum mismatch is an error.
Pure Python (no torch).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import mmap
import os

import xxhash

from kvfs.kv.block import ChecksumMismatch
from kvfs.kv.format import BlockFormatError

log = logging.getLogger(__name__)

PAGE = 4096
BACKING_XATTR = "user.kvfs.backing"
O_DIRECT = getattr(os, "O_DIRECT", 0)


def align_up(n: int, a: int = PAGE) -> int:
    return -(-n // a) * a


class AlignedBuffer:
    """A page-aligned, pre-faulted anonymous mapping (safe for O_DIRECT and fast copies)."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        self.size = align_up(size)
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mv = memoryview(self._map)
        # touch every page now: first writes to fresh memory are slow on this kind of VM
        zero = bytes(PAGE)
        for off in range(0, self.size, PAGE):
            self.mv[off:off + PAGE] = zero

    def close(self) -> None:
        self.mv.release()
        try:
            self._map.close()
        except BufferError:   # a torch.frombuffer view still exports it; freed with the view
            log.debug("aligned buffer still exported; left to the garbage collector")


def read_full(fd: int, mv: memoryview, offset: int, length: int) -> int:
    """Read up to ``length`` bytes at ``offset`` into ``mv``; returns bytes read (short only at EOF)."""
    done = 0
    while done < length:
        n = os.preadv(fd, [mv[done:length]], offset + done)
        if n == 0:
            break
        done += n
    return done


def open_for_read(path: str, direct: bool) -> tuple[int, bool]:
    """Open ``path`` read-only, with O_DIRECT if asked and the filesystem allows it."""
    if direct and O_DIRECT:
        try:
            return os.open(path, os.O_RDONLY | O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.debug("%s: O_DIRECT refused, reading buffered", path)
    return os.open(path, os.O_RDONLY), False


@dataclasses.dataclass(frozen=True)
class Backing:
    tier: str
    path: str
    offset: int
    size: int
    checksum: str
    direct: bool


def backing_info(fd: int) -> Backing | None:
    """The fast-path location of the file open on ``fd``, or None (no fast path)."""
    try:
        raw = os.getxattr(fd, BACKING_XATTR)
    except OSError:
        return None
    try:
        d = json.loads(raw)
        b = Backing(str(d["tier"]), str(d["path"]), int(d["offset"]), int(d["size"]),
                    str(d["checksum"]).lower(), bool(d.get("direct", False)))
    except (ValueError, KeyError, TypeError) as e:
        log.warning("unusable %s value %r: %s", BACKING_XATTR, raw[:200], e)
        return None
    if b.offset < 0 or b.size <= 0 or len(b.checksum) != 16:
        log.warning("unusable %s value %r", BACKING_XATTR, raw[:200])
        return None
    return b


def read_backing(b: Backing, mv: memoryview) -> int:
    """Read the whole object from its backing location into ``mv`` and verify its checksum."""
    if align_up(b.size) > len(mv):
        raise BlockFormatError(f"{b.path}: backing object of {b.size} bytes exceeds the {len(mv)}-byte buffer")
    direct = b.direct and b.offset % PAGE == 0
    fd, direct = open_for_read(b.path, direct)
    try:
        if direct:
            n = read_full(fd, mv, b.offset, align_up(b.size))
        else:
            n = read_full(fd, mv, b.offset, b.size)
    finally:
        os.close(fd)
    if n < b.size:
        raise BlockFormatError(f"{b.path}: short read of backing object ({n} of {b.size} bytes)")
    got = f"{xxhash.xxh3_64_intdigest(mv[:b.size]):016x}"
    if got != b.checksum:
        raise ChecksumMismatch(f"{b.path}: xxh3_64 {got} != {b.checksum} ({b.tier} tier)")
    return b.size


def read_block_file(path: str, mv: memoryview, *, fast_path: bool = True) -> tuple[int, str]:
    """Read a whole block file into ``mv``; returns ``(size, source)``.

    ``source`` is the backing tier name (fast path, checksum verified) or ``"mount"`` (read
    through the file itself; the caller verifies the layer checksums). Raises
    FileNotFoundError if the block is gone.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        b = backing_info(fd) if fast_path else None
        if b is not None:
            try:
                return read_backing(b, mv), b.tier
            except OSError as e:
                log.warning("%s: fast path failed (%s); reading through the mount", path, e)
        size = os.fstat(fd).st_size
        if size > len(mv):
            raise BlockFormatError(f"{path}: {size} bytes, more than a block of this layout")
        n = read_full(fd, mv, 0, size)
        if n != size:
            raise BlockFormatError(f"{path}: short read ({n} of {size} bytes)")
        return n, "mount"
    finally:
        os.close(fd)


class OpenBlock:
    """A block held open for partial (layer by layer) reads; the mount fd is the lease."""

    def __init__(self, path: str, *, fast_path: bool = True):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.backing = backing_info(self.fd) if fast_path else None
        self._bfd = -1
        self.direct = False
        self.base = 0
        if self.backing is not None:
            try:
                self._bfd, self.direct = open_for_read(self.backing.path, self.backing.direct)
                self.base = self.backing.offset
            except OSError as e:
                log.warning("%s: fast path failed (%s); reading through the mount", path, e)
                self.backing = None
        self.size = self.backing.size if self.backing else os.fstat(self.fd).st_size

    @property
    def source(self) -> str:
        return self.backing.tier if self.backing else "mount"

    def pread_into(self, mv: memoryview, offset: int, length: int) -> None:
        """Read exactly ``length`` bytes at ``offset`` of the block file into ``mv``."""
        if offset + length > self.size:
            raise BlockFormatError(f"{self.path}: read past the end ({offset}+{length} > {self.size})")
        if self._bfd >= 0:
            fd, off = self._bfd, self.base + offset
            if self.direct and (off % PAGE or length % PAGE):
                os.close(self._bfd)
                self._bfd, self.direct = open_for_read(self.backing.path, False)
                fd = self._bfd
        else:
            fd, off = self.fd, offset
        n = read_full(fd, mv, off, length)
        if n != length:
            raise BlockFormatError(f"{self.path}: short read ({n} of {length} bytes)")

    def close(self) -> None:
        if self._bfd >= 0:
            os.close(self._bfd)
            self._bfd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
