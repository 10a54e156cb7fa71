"""The kernel transport's decoders: each FUSE request's body becomes the call pyfuse3 would
make on the handlers (:class:`kvfs.fs.ops.KvfsOperations`), and each answer the kernel's
structure (kvfs/fs/wire.py). One decoder per concern, each given only what it uses;
kvfs/fs/handlers.py dispatches to them by opcode.
"""
from __future__ import annotations

import errno
import logging
import os
import time

import pyfuse3

from kvfs.fs import wire

log = logging.getLogger(__name__)


class Fields:
    """Which attributes a SETATTR changes (``pyfuse3.SetattrFields``' fields)."""

    __slots__ = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid",
                 "update_gid", "update_size", "kill_suidgid")

    def __init__(self, valid: int):
        self.update_atime = bool(valid & (wire.FATTR_ATIME | wire.FATTR_ATIME_NOW))
        self.update_mtime = bool(valid & (wire.FATTR_MTIME | wire.FATTR_MTIME_NOW))
        self.update_ctime = False
        self.update_mode = bool(valid & wire.FATTR_MODE)
        self.update_uid = bool(valid & wire.FATTR_UID)
        self.update_gid = bool(valid & wire.FATTR_GID)
        self.update_size = bool(valid & wire.FATTR_SIZE)
        self.kill_suidgid = bool(valid & wire.FATTR_KILL_SUIDGID)    # HANDLE_KILLPRIV_V2



class DirToken:
    """What ``readdir`` fills through :func:`kvfs.fs.dirreply.reply`: directory entries up
    to the size the kernel asked for (``fuse_direntplus`` with READDIRPLUS)."""

    __slots__ = ("parts", "room", "plus")

    def __init__(self, size: int, plus: bool):
        self.parts: list[bytes] = []
        self.room = size
        self.plus = plus

    def add(self, name: bytes, attr, next_id: int) -> bool:
        entry = wire.entry_bytes(attr) if self.plus else None
        rec = wire.dirent_bytes(name, attr.st_ino, next_id, attr.st_mode, entry)
        if len(rec) > self.room:
            return False
        self.parts.append(rec)
        self.room -= len(rec)
        return True


EPOCH_SHIFT = 48
EPOCH_BITS = 0x3FFF << EPOCH_SHIFT      # bits 48..61 (control handles start at bit 62)
WRITABLE = 1 << 47                      # the handle was opened for writing
VERSIONED = 1 << 46                     # a reader's handle of a sealed version: its oid below
OID_MASK = VERSIONED - 1


class Epoch:
    """File handle numbers as the kernel holds them: this daemon's epoch in bits 48..61 (its
    number in the mount's life, from the supervisor; 0 for a daemon that mounted itself), bit
    47 set for a handle opened for writing, and below either the daemon's own handle number or,
    for a reader of a sealed version, bit 46 and that version's object id (oids are never
    reused: the same number is the same bytes). A daemon that replaced a dead one
    (kvfs/supervisor.py) numbers its handles again: a handle of an older epoch is never looked
    up as one of ours (it could name another file, opened by another user); a versioned one
    may be opened again by its version (:meth:`FileDecoder._adopt`), any other gets EIO
    (:meth:`stale`). Readers of one version share one kernel number: ``shared`` keeps the
    daemon's handles behind it, one per open."""

    __slots__ = ("epoch", "tag", "shared")

    def __init__(self, epoch: int = 0):
        self.epoch = epoch & 0x3FFF
        self.tag = self.epoch << EPOCH_SHIFT
        self.shared: dict[int, list[int]] = {}

    def out(self, fh: int, writable: bool, oid: int | None = None) -> int:
        if oid is not None and not writable and 0 < oid <= OID_MASK:
            kfh = self.tag | VERSIONED | oid
            self.shared.setdefault(kfh, []).append(fh)
            return kfh
        return fh | self.tag | (WRITABLE if writable else 0)

    def local(self, kfh: int) -> int | None:
        """The daemon's number of a kernel handle; None for one of another epoch (or unknown).
        For a shared one, the handle of its oldest open (never the one a RELEASE takes while
        other opens may still read, see :meth:`released`)."""
        if kfh & EPOCH_BITS != self.tag:
            return None
        if kfh & VERSIONED:
            fhs = self.shared.get(kfh)
            return fhs[0] if fhs else None
        return kfh & ~(EPOCH_BITS | WRITABLE)

    def released(self, kfh: int) -> int | None:
        """The daemon's handle a RELEASE of ``kfh`` ends (a shared one: its newest open; the
        last RELEASE comes when no open of it is left to read)."""
        if kfh & EPOCH_BITS != self.tag or not kfh & VERSIONED:
            return self.local(kfh)
        fhs = self.shared.get(kfh)
        if not fhs:
            return None
        fh = fhs.pop()
        if not fhs:
            del self.shared[kfh]
        return fh

    stale_count = 0         # requests answered EIO for an older epoch's handle (all decoders)

    @classmethod
    def stale(cls, kfh: int) -> pyfuse3.FUSEError:
        """What a request on a handle of a dead daemon gets: EIO (its staging, its credentials
        and its version are gone with it; a passthrough reader never asks: the kernel reads
        its backing file). Counted (``transport.stale_handles``) and logged the first times."""
        cls.stale_count += 1
        if cls.stale_count <= 5:
            log.warning("a handle of epoch %d (%s) reached this daemon: EIO", kfh >> EPOCH_SHIFT & 0x3FFF,
                        "opened for writing" if kfh & WRITABLE else "opened for reading")
        return pyfuse3.FUSEError(errno.EIO)


class SessionDecoder:
    """INIT and DESTROY: the protocol version and the features (passthrough) agreed on."""

    def __init__(self, passthrough, writeback: bool = False, ops=None):
        self.passthrough = passthrough
        self.ops = ops
        self.want_writeback = writeback
        self.writeback = False  # the kernel's writeback cache, once INIT agreed on it
        self.minor = 0          # the protocol's minor version, once INIT is answered
        self.agreed: dict | None = None     # what INIT agreed on (kept by the supervisor)
        self.on_init = None     # called with ``agreed`` once INIT is answered

    def restore(self, agreed: dict) -> None:
        """The state of an INIT a daemon before this one answered (the kernel sends INIT once
        per connection; kvfs/supervisor.py keeps what it agreed on)."""
        self.agreed = dict(agreed)
        self.minor = int(agreed["minor"])
        got, offered = int(agreed["got"]), int(agreed["offered"])
        self.writeback = bool(got & wire.WRITEBACK_CACHE)
        self.passthrough.negotiated(bool(got & wire.PASSTHROUGH) and self.passthrough.wanted, offered)

    async def init(self, nodeid, body, ctx) -> list:
        major, minor, readahead, flags, flags2 = wire.INIT_IN.unpack_from(body)
        offered = flags | (flags2 << 32 if flags & wire.INIT_EXT else 0)
        if major != wire.MAJOR:
            raise pyfuse3.FUSEError(errno.EPROTO)
        self.minor = min(minor, wire.MAX_MINOR)
        want = wire.BASE_WANT | (wire.PASSTHROUGH if self.passthrough.wanted else 0) \
            | (wire.WRITEBACK_CACHE if self.want_writeback else 0)
        if not offered & wire.HANDLE_KILLPRIV_V2:
            want = want & ~wire.HANDLE_KILLPRIV_V2 | wire.HANDLE_KILLPRIV
        got = want & offered
        self.writeback = bool(got & wire.WRITEBACK_CACHE)
        if self.ops is not None:
            # who decides when setuid/setgid go (kvfs/fs/killpriv.py)
            self.ops.privs.contract = 2 if got & wire.HANDLE_KILLPRIV_V2 else 1
        self.passthrough.negotiated(bool(got & wire.PASSTHROUGH), offered)
        log.info("FUSE protocol 7.%d (kernel 7.%d); passthrough %s; writeback cache %s", self.minor,
                 minor, self.passthrough.state(), "on" if self.writeback else "off")
        self.agreed = {"minor": self.minor, "got": got, "offered": offered}
        if self.on_init is not None:
            self.on_init(self.agreed)
        return [wire.INIT_OUT.pack(wire.MAJOR, self.minor, readahead, got & 0xFFFFFFFF, 0, 0,
                                   (1 << 20), 1, (1 << 20) // 4096, 0, got >> 32,
                                   1 if got & wire.PASSTHROUGH else 0, 0)]

    async def destroy(self, nodeid, body, ctx) -> list:
        return []


class EntryDecoder:
    """Names and attributes: LOOKUP, GETATTR, SETATTR, the name changes, FORGET."""

    def __init__(self, ops, epoch: Epoch | None = None):
        self.ops = ops
        self.epoch = epoch or Epoch()

    async def forget(self, opcode: int, nodeid: int, body) -> None:
        if opcode == wire.FORGET:
            pairs = [(nodeid, wire.FORGET_IN.unpack_from(body)[0])]
        else:
            count = wire.BATCH_FORGET_IN.unpack_from(body)[0]
            off = wire.BATCH_FORGET_IN.size
            pairs = [wire.FORGET_ONE.unpack_from(body, off + i * 16) for i in range(count)]
        try:
            await self.ops.forget(pairs)
        except Exception:        # noqa: BLE001
            log.exception("forget failed")

    async def lookup(self, nodeid, body, ctx) -> list:
        name, = wire.names_in(body, 1)
        return [wire.entry_bytes(await self.ops.lookup(nodeid, name, ctx))]

    async def getattr(self, nodeid, body, ctx) -> list:
        return [wire.attr_out_bytes(await self.ops.getattr(nodeid, ctx))]

    async def setattr(self, nodeid, body, ctx) -> list:
        (valid, _, fh, size, _, atime, mtime, _, atimens, mtimens, _, mode, _, uid, gid,
         _) = wire.SETATTR_IN.unpack_from(body)
        attr = pyfuse3.EntryAttributes()
        now = time.time_ns()
        attr.st_size, attr.st_mode, attr.st_uid, attr.st_gid = size, mode, uid, gid
        attr.st_atime_ns = now if valid & wire.FATTR_ATIME_NOW else atime * 1_000_000_000 + atimens
        attr.st_mtime_ns = now if valid & wire.FATTR_MTIME_NOW else mtime * 1_000_000_000 + mtimens
        kfh, fh = fh, self.epoch.local(fh) if valid & wire.FATTR_FH else None
        if valid & wire.FATTR_FH and fh is None:
            if valid & wire.FATTR_SIZE:         # a truncate through a dead daemon's handle
                raise self.epoch.stale(kfh)
            fh = None                           # the rest is the inode's: by its node id
        return [wire.attr_out_bytes(await self.ops.setattr(nodeid, attr, Fields(valid), fh, ctx))]

    async def readlink(self, nodeid, body, ctx) -> list:
        return [bytes(await self.ops.readlink(nodeid, ctx))]

    async def symlink(self, nodeid, body, ctx) -> list:
        name, target = wire.names_in(body, 2)
        return [wire.entry_bytes(await self.ops.symlink(nodeid, name, target, ctx))]

    async def mknod(self, nodeid, body, ctx) -> list:
        mode, rdev, umask, _ = wire.MKNOD_IN.unpack_from(body)
        name, = wire.names_in(body[wire.MKNOD_IN.size:], 1)
        ctx.umask = umask
        return [wire.entry_bytes(await self.ops.mknod(nodeid, name, mode, rdev, ctx))]

    async def mkdir(self, nodeid, body, ctx) -> list:
        mode, umask = wire.MKDIR_IN.unpack_from(body)
        name, = wire.names_in(body[wire.MKDIR_IN.size:], 1)
        ctx.umask = umask
        return [wire.entry_bytes(await self.ops.mkdir(nodeid, name, mode, ctx))]

    async def unlink(self, nodeid, body, ctx) -> list:
        await self.ops.unlink(nodeid, wire.names_in(body, 1)[0], ctx)
        return []

    async def rmdir(self, nodeid, body, ctx) -> list:
        await self.ops.rmdir(nodeid, wire.names_in(body, 1)[0], ctx)
        return []

    async def rename(self, nodeid, body, ctx) -> list:
        newdir = wire.RENAME_IN.unpack_from(body)[0]
        old, new = wire.names_in(body[wire.RENAME_IN.size:], 2)
        await self.ops.rename(nodeid, old, newdir, new, 0, ctx)
        return []

    async def rename2(self, nodeid, body, ctx) -> list:
        newdir, flags, _ = wire.RENAME2_IN.unpack_from(body)
        old, new = wire.names_in(body[wire.RENAME2_IN.size:], 2)
        await self.ops.rename(nodeid, old, newdir, new, flags, ctx)
        return []

    async def link(self, nodeid, body, ctx) -> list:
        old = wire.LINK_IN.unpack_from(body)[0]
        name, = wire.names_in(body[wire.LINK_IN.size:], 1)
        return [wire.entry_bytes(await self.ops.link(old, nodeid, name, ctx))]


class FileDecoder:
    """Open files' data: OPEN, CREATE, READ, WRITE, FLUSH, FSYNC, RELEASE (with passthrough's
    backing files)."""

    def __init__(self, ops, passthrough, epoch: Epoch | None = None):
        self.ops = ops
        self.passthrough = passthrough
        self.epoch = epoch or Epoch()
        self.adopted: dict[int, int] = {}   # an older epoch's versioned handle -> ours
        self.readopened = 0

    async def open(self, nodeid, body, ctx) -> list:
        flags, open_flags = wire.OPEN_IN.unpack_from(body)
        fi = await self.ops.open(nodeid, flags, ctx, kill=bool(open_flags & wire.OPEN_KILL_SUIDGID))
        return [self.open_out(fi, flags)]

    async def create(self, nodeid, body, ctx) -> list:
        flags, mode, umask, _ = wire.CREATE_IN.unpack_from(body)
        name, = wire.names_in(body[wire.CREATE_IN.size:], 1)
        ctx.umask = umask
        fi, attr = await self.ops.create(nodeid, name, mode, flags, ctx)
        return [wire.entry_bytes(attr), self.open_out(fi, flags)]

    def _sealed_oid(self, fh: int) -> int | None:
        """The object id of the sealed version a reader's handle ``fh`` reads (None: a writer,
        a reader of a file being written, a control file)."""
        files = getattr(getattr(self.ops, "store", None), "files", None)
        h = files.handles.get(fh) if files is not None else None
        if h is None or h.write or h.obj is None:
            return None
        oid = h.obj.oid
        return oid if isinstance(oid, int) else None

    def open_out(self, fi, open_flags: int = os.O_RDONLY) -> bytes:
        flags = ((wire.FOPEN_DIRECT_IO if fi.direct_io else 0) | (wire.FOPEN_KEEP_CACHE if fi.keep_cache else 0)
                 | (wire.FOPEN_NONSEEKABLE if fi.nonseekable else 0))
        writable = open_flags & os.O_ACCMODE != os.O_RDONLY
        fh = self.epoch.out(fi.fh, writable, None if writable else self._sealed_oid(fi.fh))
        backing = self.passthrough.answer(fi.fh)
        if backing is not None:
            backing_id, extra = backing
            return wire.OPEN_OUT.pack(fh, extra, backing_id)
        return wire.OPEN_OUT.pack(fh, flags, 0)

    def _local(self, kfh: int) -> int:
        fh = self.epoch.local(kfh)
        if fh is None:
            raise self.epoch.stale(kfh)
        return fh

    async def _adopt(self, kfh: int, nodeid: int, ctx) -> int:
        """A reader's handle of a dead daemon (an older epoch) that names its version: the
        inode opened again for reading, kept only if it reads that very object (same oid, same
        bytes); else EIO. Kept until the handle's RELEASE."""
        fh = self.adopted.get(kfh)
        if fh is not None:
            return fh
        if kfh & (VERSIONED | WRITABLE) != VERSIONED or (kfh & EPOCH_BITS) == self.epoch.tag:
            raise self.epoch.stale(kfh)
        try:
            fi = await self.ops.open(nodeid, os.O_RDONLY, ctx)
        except pyfuse3.FUSEError:
            raise self.epoch.stale(kfh) from None
        self.passthrough.answer(fi.fh)          # no OPEN reply carries it
        if self._sealed_oid(fi.fh) != kfh & OID_MASK or kfh in self.adopted:
            await self._release_local(fi.fh)
            if kfh in self.adopted:
                return self.adopted[kfh]
            raise self.epoch.stale(kfh)         # another version now: never its bytes
        self.adopted[kfh] = fi.fh
        self.readopened += 1
        return fi.fh

    async def _release_local(self, fh: int) -> None:
        try:
            await self.ops.release(fh)
        finally:
            self.passthrough.release(fh)

    async def read(self, nodeid, body, ctx) -> list:
        kfh, off, size, *_ = wire.READ_IN.unpack_from(body)
        fh = self.epoch.local(kfh)
        if fh is None:
            fh = await self._adopt(kfh, nodeid, ctx)
        return [await self.ops.read(fh, off, size)]

    async def write(self, nodeid, body, ctx) -> list:
        fh, off, size, write_flags, *_ = wire.WRITE_IN.unpack_from(body)
        data = bytes(body[wire.WRITE_IN.size:wire.WRITE_IN.size + size])
        kill = ctx if write_flags & wire.WRITE_KILL_SUIDGID else None
        return [wire.WRITE_OUT.pack(await self.ops.write(self._local(fh), off, data, kill), 0)]

    async def flush(self, nodeid, body, ctx) -> list:
        kfh = wire.FLUSH_IN.unpack_from(body)[0]
        fh = self.epoch.local(kfh)
        if fh is None:
            if kfh & WRITABLE:      # what it wrote died with its daemon: close(2) says so
                raise self.epoch.stale(kfh)
            return []               # a reader's close is not an error
        await self.ops.flush(fh)
        return []

    async def release(self, nodeid, body, ctx) -> list:
        kfh = wire.RELEASE_IN.unpack_from(body)[0]
        fh = self.epoch.released(kfh)
        if fh is None:
            fh = self.adopted.pop(kfh, None)    # opened again for a dead daemon's reader
            if fh is None:
                return []           # a dead daemon's handle: nothing of it is left here
        await self._release_local(fh)
        return []

    async def fsync(self, nodeid, body, ctx) -> list:
        fh, flags, _ = wire.FSYNC_IN.unpack_from(body)
        await self.ops.fsync(self._local(fh), bool(flags & 1))
        return []


class DirDecoder:
    """Directories: OPENDIR, READDIR(PLUS), RELEASEDIR, FSYNCDIR; and ACCESS."""

    def __init__(self, ops):
        self.ops = ops

    async def opendir(self, nodeid, body, ctx) -> list:
        fh = await self.ops.opendir(nodeid, ctx)
        return [wire.OPEN_OUT.pack(fh, 0, 0)]

    async def readdir(self, nodeid, body, ctx, plus: bool = False) -> list:
        fh, off, size, *_ = wire.READ_IN.unpack_from(body)
        token = DirToken(size, plus)
        await self.ops.readdir(fh, off, token)
        return token.parts

    async def readdirplus(self, nodeid, body, ctx) -> list:
        return await self.readdir(nodeid, body, ctx, plus=True)

    async def releasedir(self, nodeid, body, ctx) -> list:
        await self.ops.releasedir(wire.RELEASE_IN.unpack_from(body)[0])
        return []

    async def fsyncdir(self, nodeid, body, ctx) -> list:
        return []

    async def access(self, nodeid, body, ctx) -> list:
        await self.ops.access(nodeid, wire.GETXATTR_IN.unpack_from(body)[0], ctx)
        return []


class XattrDecoder:
    """Extended attributes, and STATFS."""

    def __init__(self, ops):
        self.ops = ops

    async def setxattr(self, nodeid, body, ctx) -> list:
        size, flags = wire.SETXATTR_IN.unpack_from(body)
        rest = body[wire.SETXATTR_IN.size:]
        name, = wire.names_in(rest, 1)
        value = bytes(rest[len(name) + 1:len(name) + 1 + size])
        if flags & (os.XATTR_CREATE | os.XATTR_REPLACE):
            # the flags are the filesystem's to honour (pyfuse3 does it the same way)
            try:
                await self.ops.getxattr(nodeid, name, ctx)
            except pyfuse3.FUSEError as e:
                if e.errno != errno.ENODATA or flags & os.XATTR_REPLACE:
                    raise
            else:
                if flags & os.XATTR_CREATE:
                    raise pyfuse3.FUSEError(errno.EEXIST)
        await self.ops.setxattr(nodeid, name, value, ctx)
        return []

    async def getxattr(self, nodeid, body, ctx) -> list:
        size, _ = wire.GETXATTR_IN.unpack_from(body)
        name, = wire.names_in(body[wire.GETXATTR_IN.size:], 1)
        return self.sized(bytes(await self.ops.getxattr(nodeid, name, ctx)), size)

    async def listxattr(self, nodeid, body, ctx) -> list:
        size, _ = wire.GETXATTR_IN.unpack_from(body)
        names = await self.ops.listxattr(nodeid, ctx)
        return self.sized(b"".join(bytes(n) + b"\0" for n in names), size)

    @staticmethod
    def sized(value: bytes, size: int) -> list:
        if size == 0:
            return [wire.GETXATTR_OUT.pack(len(value), 0)]
        if len(value) > size:
            raise pyfuse3.FUSEError(errno.ERANGE)
        return [value]

    async def removexattr(self, nodeid, body, ctx) -> list:
        await self.ops.removexattr(nodeid, wire.names_in(body, 1)[0], ctx)
        return []

    async def statfs(self, nodeid, body, ctx) -> list:
        s = await self.ops.statfs(ctx)
        return [wire.STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree,
                                     s.f_bsize, s.f_namemax, s.f_frsize, 0)]
