"""Where the NVMe tier keeps each object file's own record (for ``kvfs fsck --repair``).

A record is CBOR (id, size, whole checksum, chunk size, per-chunk checksums, key,
generation). Its size grows with the object: 8 bytes per ``chunk_size`` piece, so a
1 GiB object at 1 MiB chunks carries 8 KiB of checksums, and a long key adds up to 4 KiB.
Filesystems bound an xattr value: ext4 at one block minus its headers (~4 KiB with 4 KiB
blocks, ~1 KiB with 1 KiB blocks), and the Linux VFS at 64 KiB on every filesystem. So:

* a record of up to ``XATTR_MAX`` bytes (what fits even in a 1 KiB-block ext4 xattr)
  goes in the ``user.kvfs.object`` xattr of the object file, as it always did;
* a larger one, or one the filesystem refuses as too big (E2BIG, ERANGE, or ENOSPC,
  which ext4 returns for a value over its cap), goes in a side file ``<id>.rec`` beside
  the object file: the record followed by the xxh3-64 of the record, so a torn side file
  is refused, not trusted.

An xattr refused as too big is never a full disk: only a failed write of the side file
(a real data write) is. The side file is written (and fsynced, unless the tier defers its
syncs to one ``syncfs``) before the object file is renamed into place, so an object file
that exists always has its whole record; it is unlinked before the object file, so a crash
in between leaves an object file without a record (which the index no longer names and
the orphan sweep removes), never a record that describes other bytes.
"""
from __future__ import annotations

import errno
import logging
import os
import struct

import xxhash

log = logging.getLogger(__name__)

RECORD_XATTR = "user.kvfs.object"
SIDE_SUFFIX = ".rec"
XATTR_MAX = 960             # a 1 KiB ext4 block less its header, entry and end marker
_TOO_BIG = (errno.E2BIG, errno.ERANGE, errno.ENOSPC)
# no user xattrs here (EPERM: under another kvfs mount the user.kvfs.* names are its own)
UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM)
_SUM = struct.Struct("<Q")
_SIDE_MAX = 64 << 20        # 8 B per chunk: an object of 8 TiB at 1 MiB chunks


def side_name(name: str) -> str:
    return name + SIDE_SUFFIX


def store(fd: int, shard: int, name: str, raw: bytes, *, sync: bool) -> str:
    """Attach ``raw`` to the object file open as ``fd`` (to be renamed to ``name`` in the
    directory ``shard``): "xattr" or "side" (where it went). Raises OSError with an
    UNSUPPORTED errno when a small record finds no user xattrs on this filesystem."""
    if len(raw) <= XATTR_MAX:
        try:
            os.setxattr(fd, RECORD_XATTR, raw)
            return "xattr"
        except OSError as e:
            if e.errno not in _TOO_BIG:
                raise
            log.debug("object %s: record of %d bytes refused as an xattr (%s); side file", name,
                      len(raw), os.strerror(e.errno))
    _write_side(shard, side_name(name), raw + _SUM.pack(xxhash.xxh3_64_intdigest(raw)), sync)
    return "side"


def _write_side(shard: int, side: str, body: bytes, sync: bool) -> None:
    fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=shard)
    try:
        view = memoryview(body)
        while view:
            done = os.write(fd, view)
            if done <= 0:
                raise OSError(errno.ENOSPC, "no progress writing an object record")
            view = view[done:]
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        remove_side(shard, side)
        raise
    os.close(fd)


def remove_side(shard: int, side: str) -> None:
    """Unlink ``side`` in ``shard`` (gone already: fine)."""
    try:
        os.unlink(side, dir_fd=shard)
    except FileNotFoundError:
        pass


def leftovers(shards: list[int]) -> list[tuple[int, str]]:
    """(shard descriptor, name) of each file a put cut off by a crash left: its ``.tmp``
    object file, or a side file whose object file never got its name. Offline only (fsck):
    a put in flight has both for a moment."""
    out = []
    for shard in shards:
        names = set(os.listdir(shard))
        out += [(shard, n) for n in sorted(names) if n.endswith(".tmp")
                or (n.endswith(SIDE_SUFFIX) and n[:-len(SIDE_SUFFIX)] not in names)]
    return out


def load(fd: int, shard: int, name: str) -> bytes | None:
    """The record of the object file open as ``fd`` (named ``name`` in ``shard``): its
    xattr, else its side file (checked); None when it has neither or the side file is torn."""
    try:
        return os.getxattr(fd, RECORD_XATTR)
    except OSError as e:
        if e.errno not in (errno.ENODATA, *UNSUPPORTED):
            return None
    try:
        sfd = os.open(side_name(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=shard)
    except OSError:
        return None
    try:
        body = bytearray()
        while len(body) <= _SIDE_MAX:
            piece = os.read(sfd, 1 << 20)
            if not piece:
                break
            body += piece
    finally:
        os.close(sfd)
    if len(body) < _SUM.size or len(body) > _SIDE_MAX:
        return None
    raw = bytes(body[:-_SUM.size])
    if _SUM.unpack_from(body, len(raw))[0] != xxhash.xxh3_64_intdigest(raw):
        log.warning("object %s: its record file %s is torn; skipped", name, side_name(name))
        return None
    return raw
