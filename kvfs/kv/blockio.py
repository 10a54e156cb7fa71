"""Reading block files: page-aligned buffers, full reads, and the fast path beside FUSE.

Fast path, batched (daemon protocol, ``kvfs/fs/control.py``): the loader writes the names of
all the blocks it is about to read to ``<mount>/.kvfs/lease`` and reads back, in one round
trip, each block's backing location ``[tier, path, offset, size, xxh3_64, direct]`` (the
RAM tier's tmpfs file or the NVMe tier's file) or ``null`` (no fast path: read through the
mount). The daemon holds the leased objects where they are (no demotion, eviction or free)
until the loader releases the lease (``\0release``, its next request, or closing the fd) or
the lease's ttl passes. The loader reads ``size`` bytes at ``offset`` of ``path`` (O_DIRECT
when ``direct``) and checks their xxh3_64 before using them; a vanished path falls back to
the mount, a mismatch is an error.

Fast path, one file: with the block open through the mount (the open fd is the lease),
``getxattr(fd, "user.kvfs.backing")`` returns the same location as JSON (used when no lease
file exists). Pure Python (no torch).
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import mmap
import os
import threading

import xxhash

from kvfs import protocol
from kvfs.kv.block import ChecksumMismatch
from kvfs.blockformat import BlockFormatError
from kvfs.protocol import BACKING_XATTR, Backing, decode_backing_xattr, decode_lease_entry

log = logging.getLogger(__name__)

PAGE = protocol.ALIGN
O_DIRECT = getattr(os, "O_DIRECT", 0)


def align_up(n: int, a: int = PAGE) -> int:
    return -(-n // a) * a


class AlignedBuffer:
    """A page-aligned, pre-faulted anonymous mapping (safe for O_DIRECT and fast copies)."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        self.size = align_up(size)
        self.mapping = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mv = memoryview(self.mapping)
        # touch every page now: first writes to fresh memory are slow on this kind of VM
        zero = bytes(PAGE)
        for off in range(0, self.size, PAGE):
            self.mv[off:off + PAGE] = zero

    def close(self) -> None:
        self.mv.release()
        try:
            self.mapping.close()
        except BufferError:   # a torch.frombuffer view still exports it; freed with the view
            log.debug("aligned buffer still exported; left to the garbage collector")


def page_aligned(mv: memoryview) -> bool:
    """Whether a writable buffer starts on a page boundary (O_DIRECT may read into it)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv)) % PAGE == 0
    except (TypeError, ValueError):     # read-only, or not a plain buffer
        return False


def read_full(fd: int, mv: memoryview, offset: int, length: int) -> int:
    """Read up to ``length`` bytes at ``offset`` into ``mv``; returns bytes read (short only at EOF)."""
    done = 0
    while done < length:
        n = os.preadv(fd, [mv[done:length]], offset + done)
        if n == 0:
            break
        done += n
    return done


def preadv_full(fd: int, bufs: list, offset: int, total: int | None = None) -> int:
    """``preadv`` into ``bufs`` (``total`` bytes, if known) until full or EOF; returns bytes read."""
    if total is None:
        total = sum(len(b) for b in bufs)
    done = os.preadv(fd, bufs, offset)
    if done == total or done == 0:
        return done
    mvs = [memoryview(b).cast("B") for b in bufs]
    while done < total:
        skip, rest = done, []
        for mv in mvs:
            if skip >= len(mv):
                skip -= len(mv)
                continue
            rest.append(mv[skip:])
            skip = 0
        n = os.preadv(fd, rest, offset + done)
        if n == 0:
            break
        done += n
    return done


def write_all(fd: int, bufs: list, offset: int | None = None) -> int:
    """``writev`` (``pwritev`` at ``offset``) every byte of ``bufs``, resuming after short
    writes; returns the bytes written."""
    views = [memoryview(b).cast("B") for b in bufs]
    done = 0
    while views:
        k = os.writev(fd, views) if offset is None else os.pwritev(fd, views, offset + done)
        done += k
        while views and k >= len(views[0]):
            k -= len(views[0])
            views.pop(0)
        if views and k:
            views[0] = views[0][k:]
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


class LeaseClient:
    """Batched fast-path locations for blocks under ``root`` (a directory in a kvfs mount)."""

    def __init__(self, mount_root: str, root: str, *, ttl: float | None = None):
        self.root = os.path.realpath(root)
        self.base = os.path.relpath(self.root, mount_root)
        self.ttl = ttl
        self._fd = os.open(os.path.join(mount_root, protocol.CONTROL_NAME, protocol.LEASE_FILE), os.O_RDWR)
        self._lock = threading.Lock()
        self._held = False
        self.generation = 0            # counts leases acquired on this descriptor

    @classmethod
    def open(cls, mount_root: str | None, root: str, **kw) -> "LeaseClient | None":
        if mount_root is None:
            return None
        try:
            return cls(mount_root, root, **kw)
        except OSError as e:            # an older daemon without .kvfs/lease
            log.debug("no lease file under %s: %s", mount_root, e)
            return None

    def rel(self, path: str) -> str | None:
        head = self.root + os.sep
        return path[len(head):] if path.startswith(head) else None

    def acquire(self, rels: list[str]) -> list[Backing | None]:
        """Lease the leading sealed blocks of ``rels``: one entry per leased block (a prefix
        of ``rels``; a block past it was not sealed when asked)."""
        from kvfs.kv.lookup import transact
        req = protocol.request(self.base, rels, self.ttl)
        with self._lock:
            raw = transact(self._fd, req)      # (this request also ends the previous lease)
            self._held = True
            self.generation += 1
        try:
            answer = json.loads(raw)
            blocks = answer["blocks"]
            if not isinstance(blocks, list) or len(blocks) > len(rels):
                raise ValueError("blocks")
        except (ValueError, KeyError, TypeError) as e:
            raise OSError(f"bad lease answer {raw[:200]!r}: {e}") from None
        return [decode_lease_entry(b) for b in blocks]

    def release(self, generation: int | None = None) -> None:
        """Give the lease back (writing a new request releases the last one). With
        ``generation``, only that lease: a later ``acquire`` has already ended it."""
        with self._lock:
            if self._held and (generation is None or generation == self.generation):
                os.pwrite(self._fd, protocol.RELEASE_REQUEST, 0)
                self._held = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)           # closing the fd releases any lease still held
            self._fd = -1


class VerifiedObjects:
    """Shared-memory objects this process has hashed and found intact, by file identity.

    A RAM-tier object is a tmpfs file the daemon never changes once sealed. After the loader
    has read one and its xxh3 matched, later reads of the same file skip the hash while the
    file is provably the one verified: same path, offset, size and daemon checksum, and the
    same device, inode, size, mtime and ctime (a write or truncate through the file API
    changes them; an unlinked and recreated object is another inode). What this trusts is
    what the page cache trusts: bytes in memory are not re-hashed on every read. Objects
    read from a lower tier (NVMe with O_DIRECT) are always hashed."""

    def __init__(self, limit: int = 1 << 16):
        self.limit = limit
        self._keys: dict = {}

    @staticmethod
    def key(b: Backing, st: os.stat_result) -> tuple:
        return (b.path, b.offset, b.size, b.checksum, st.st_dev, st.st_ino, st.st_size,
                st.st_mtime_ns, st.st_ctime_ns)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key) -> None:
        self._keys[key] = None
        if len(self._keys) > self.limit:
            try:
                self._keys.pop(next(iter(self._keys)), None)
            except (RuntimeError, StopIteration):      # another reader changed it meanwhile
                pass

    def clear(self) -> None:
        self._keys.clear()


def mismatch(b: Backing, got: str) -> ChecksumMismatch:
    return ChecksumMismatch(f"{b.path}: xxh3_64 {got} != {b.checksum} ({b.tier} tier)")


def read_backing_into(b: Backing, head: memoryview, segs: list, cuts: list[tuple[int, int, int]], *,
                      direct: bool = False, verified: VerifiedObjects | None = None) -> int:
    """Read a block object from its backing file straight into ``head`` (its first
    ``len(head)`` bytes: the header) and the payload's scattered destination ``segs``
    (buffers in file order), then verify the object's xxh3_64. ``cuts`` groups ``segs`` into
    pieces ``(first, end, nbytes)`` of ~512 KiB: each piece is hashed right after it lands,
    while it is still in the CPU cache. ``direct``: O_DIRECT (every buffer page aligned,
    whole pages). ``verified``: skip the hash of a shared-memory object already verified
    unchanged (one ``preadv`` for the whole object); record it once verified."""
    fd, _ = open_for_read(b.path, direct)
    try:
        key = None
        if verified is not None:
            key = verified.key(b, os.fstat(fd))
            if key in verified:
                n = preadv_full(fd, [head, *segs], b.offset, b.size)
                if n < b.size:
                    raise BlockFormatError(f"{b.path}: short read of backing object ({n} of {b.size} bytes)")
                return n
        n = preadv_full(fd, [head], b.offset, len(head))
        h = xxhash.xxh3_64(head)
        for first, end, size in cuts:
            part = segs[first:end]
            n += preadv_full(fd, part, b.offset + n, size)
            for seg in part:
                h.update(seg)
    finally:
        os.close(fd)
    if n < b.size:
        raise BlockFormatError(f"{b.path}: short read of backing object ({n} of {b.size} bytes)")
    got = h.hexdigest()
    if got != b.checksum:
        raise mismatch(b, got)
    if key is not None:
        verified.add(key)
    return n


def backing_info(fd: int) -> Backing | None:
    """The fast-path location of the file open on ``fd``, or None (no fast path)."""
    try:
        raw = os.getxattr(fd, BACKING_XATTR)
    except OSError:
        return None
    return decode_backing_xattr(raw)


def read_backing(b: Backing, mv: memoryview, *, verified: VerifiedObjects | None = None,
                 check: bool = True) -> int:
    """Read the whole object from its backing location into ``mv`` and verify its checksum
    (``verified``: as for ``read_backing_into``; ``check=False``: the caller hashes the bytes
    itself before using them, see ``Loader._read_copy``)."""
    if align_up(b.size) > len(mv):
        raise BlockFormatError(f"{b.path}: backing object of {b.size} bytes exceeds the {len(mv)}-byte buffer")
    direct = b.direct and b.offset % PAGE == 0
    fd, direct = open_for_read(b.path, direct)
    key = None
    try:
        if verified is not None and not direct:
            key = verified.key(b, os.fstat(fd))
        if direct:
            n = read_full(fd, mv, b.offset, align_up(b.size))
        else:
            n = read_full(fd, mv, b.offset, b.size)
    finally:
        os.close(fd)
    if n < b.size:
        raise BlockFormatError(f"{b.path}: short read of backing object ({n} of {b.size} bytes)")
    if not check or (key is not None and key in verified):
        return b.size
    got = f"{xxhash.xxh3_64_intdigest(mv[:b.size]):016x}"
    if got != b.checksum:
        raise mismatch(b, got)
    if key is not None:
        verified.add(key)
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
    """A block held open for partial (layer by layer) reads; the mount fd (or the lease
    that handed out ``backing``) keeps its bytes in place."""

    def __init__(self, path: str, *, fast_path: bool = True, backing: Backing | None = None):
        self.path = path
        if backing is not None:
            self.fd = -1
            self.backing = backing
        else:
            self.fd = os.open(path, os.O_RDONLY)
            self.backing = backing_info(self.fd) if fast_path else None
        self._bfd = -1
        self.direct = False
        self.base = 0
        self.trusted = False           # set by the loader: bytes already verified, unchanged
        if self.backing is not None:
            try:
                self._bfd, self.direct = open_for_read(self.backing.path, self.backing.direct)
                self.base = self.backing.offset
            except OSError as e:
                log.warning("%s: fast path failed (%s); reading through the mount", path, e)
                self.backing = None
                if self.fd < 0:
                    self.fd = os.open(path, os.O_RDONLY)
        self.size = self.backing.size if self.backing else os.fstat(self.fd).st_size

    @property
    def source(self) -> str:
        return self.backing.tier if self.backing else "mount"

    def backing_stat(self) -> os.stat_result | None:
        """``fstat`` of the open backing file (None when reading through the mount)."""
        return os.fstat(self._bfd) if self._bfd >= 0 else None

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
