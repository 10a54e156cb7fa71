"""The kernel transport's request decoding and reply encoding (kvfs/fs/session.py reads the
requests): each FUSE request becomes the call pyfuse3 would make on the handlers
(:class:`kvfs.fs.ops.KvfsOperations`), and each answer the kernel's structure (kvfs/fs/wire.py).
"""
from __future__ import annotations

import errno
import logging
import os
import time

import pyfuse3

from kvfs.fs import wire
from kvfs.fs.passthrough import Passthrough

log = logging.getLogger(__name__)


class Context:
    """The caller of a request (``pyfuse3.RequestContext``'s fields)."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int, gid: int, pid: int, umask: int = 0):
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask


class Fields:
    """Which attributes a SETATTR changes (``pyfuse3.SetattrFields``' fields)."""

    __slots__ = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid",
                 "update_gid", "update_size")

    def __init__(self, valid: int):
        self.update_atime = bool(valid & (wire.FATTR_ATIME | wire.FATTR_ATIME_NOW))
        self.update_mtime = bool(valid & (wire.FATTR_MTIME | wire.FATTR_MTIME_NOW))
        self.update_ctime = False
        self.update_mode = bool(valid & wire.FATTR_MODE)
        self.update_uid = bool(valid & wire.FATTR_UID)
        self.update_gid = bool(valid & wire.FATTR_GID)
        self.update_size = bool(valid & wire.FATTR_SIZE)


# answers of more pieces than this are joined into one before writev (IOV_MAX is 1024)
REPLY_PARTS = 256

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


class Handlers:
    """Decode, call, encode; one instance per session."""

    def __init__(self, ops, fd: int, want_passthrough: bool):
        self.ops = ops
        self.fd = fd
        self.minor = 0
        self.passthrough = Passthrough(fd, want_passthrough)
        ops.opens.passthrough = self.passthrough
        self.counts: dict[int, int] = {}
        self._table = {
            wire.LOOKUP: self._lookup, wire.GETATTR: self._getattr, wire.SETATTR: self._setattr,
            wire.READLINK: self._readlink, wire.SYMLINK: self._symlink, wire.MKNOD: self._mknod,
            wire.MKDIR: self._mkdir, wire.UNLINK: self._unlink, wire.RMDIR: self._rmdir,
            wire.RENAME: self._rename, wire.RENAME2: self._rename2, wire.LINK: self._link,
            wire.OPEN: self._open, wire.READ: self._read, wire.WRITE: self._write,
            wire.STATFS: self._statfs, wire.RELEASE: self._release, wire.FSYNC: self._fsync,
            wire.SETXATTR: self._setxattr, wire.GETXATTR: self._getxattr,
            wire.LISTXATTR: self._listxattr, wire.REMOVEXATTR: self._removexattr,
            wire.FLUSH: self._flush, wire.INIT: self._init, wire.OPENDIR: self._opendir,
            wire.READDIR: self._readdir, wire.READDIRPLUS: self._readdirplus,
            wire.RELEASEDIR: self._releasedir, wire.FSYNCDIR: self._fsyncdir,
            wire.ACCESS: self._access, wire.CREATE: self._create, wire.DESTROY: self._destroy,
        }

    def close(self) -> None:
        self.passthrough.close()

    def requests(self) -> dict[str, int]:
        """Requests that reached the daemon, by opcode name."""
        return {wire.NAMES.get(k, str(k)): v for k, v in sorted(self.counts.items())}

    # ---- dispatch -------------------------------------------------------------------------
    async def handle(self, req: memoryview) -> None:
        _, opcode, unique, nodeid, uid, gid, pid, _, _ = wire.IN_HEADER.unpack_from(req)
        body = req[wire.IN_HEADER.size:]
        self.counts[opcode] = self.counts.get(opcode, 0) + 1
        if opcode in wire.NO_REPLY:
            if opcode != wire.INTERRUPT:
                await self._forget(opcode, nodeid, body)
            return
        fn = self._table.get(opcode)
        if fn is None:
            self.reply_error(unique, errno.ENOSYS)
            return
        try:
            parts = await fn(nodeid, body, Context(uid, gid, pid))
        except pyfuse3.FUSEError as e:
            self.reply_error(unique, e.errno)
            return
        except Exception:            # noqa: BLE001 - a handler's bug must not wedge the caller
            log.exception("%s failed", wire.NAMES.get(opcode, opcode))
            self.reply_error(unique, errno.EIO)
            return
        if not self.reply(unique, parts) and opcode in (wire.OPEN, wire.CREATE):
            # the opener was interrupted: no RELEASE will come for this handle
            fh = wire.OPEN_OUT.unpack_from(parts[-1])[0]
            try:
                await self.ops.release(fh)
            finally:
                self.passthrough.release(fh)

    def reply(self, unique: int, parts: list) -> bool:
        size = wire.OUT_HEADER.size + sum(len(p) for p in parts)
        if len(parts) >= REPLY_PARTS:    # writev takes at most IOV_MAX (1024) pieces
            parts = [b"".join(parts)]
        err = self._send([wire.OUT_HEADER.pack(size, 0, unique), *parts])
        if err not in (0, errno.ENOENT, errno.ENODEV):
            # the kernel refused the answer (a bug of ours): an error, or the caller waits forever
            self.reply_error(unique, errno.EIO)
        return err == 0

    def reply_error(self, unique: int, err: int) -> None:
        self._send([wire.OUT_HEADER.pack(wire.OUT_HEADER.size, -(err or errno.EIO), unique)])

    def _send(self, parts: list) -> int:
        """Write one answer; 0 or the errno (ENOENT: the request was interrupted; ENODEV:
        unmounted; anything else is logged)."""
        try:
            os.writev(self.fd, parts)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("reply to the kernel failed: %s", e)
            return e.errno
        return 0

    def notify(self, msg: bytes) -> None:
        """A notification written on the session's own device (when no helper holds a clone)."""
        os.write(self.fd, msg)

    # ---- session --------------------------------------------------------------------------
    async def _init(self, nodeid, body, ctx) -> list:
        major, minor, readahead, flags, flags2 = wire.INIT_IN.unpack_from(body)
        offered = flags | (flags2 << 32 if flags & wire.INIT_EXT else 0)
        if major != wire.MAJOR:
            raise pyfuse3.FUSEError(errno.EPROTO)
        self.minor = min(minor, wire.MAX_MINOR)
        want = wire.BASE_WANT | (wire.PASSTHROUGH if self.passthrough.wanted else 0)
        got = want & offered
        self.passthrough.negotiated(bool(got & wire.PASSTHROUGH), offered)
        log.info("FUSE protocol 7.%d (kernel 7.%d); passthrough %s", self.minor, minor,
                 self.passthrough.state())
        return [wire.INIT_OUT.pack(wire.MAJOR, self.minor, readahead, got & 0xFFFFFFFF, 0, 0,
                                   (1 << 20), 1, (1 << 20) // 4096, 0, got >> 32,
                                   1 if got & wire.PASSTHROUGH else 0, 0)]

    async def _destroy(self, nodeid, body, ctx) -> list:
        return []

    async def _forget(self, opcode: int, nodeid: int, body) -> None:
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

    # ---- names and attributes ---------------------------------------------------------------
    async def _lookup(self, nodeid, body, ctx) -> list:
        name, = wire.names_in(body, 1)
        return [wire.entry_bytes(await self.ops.lookup(nodeid, name, ctx))]

    async def _getattr(self, nodeid, body, ctx) -> list:
        return [wire.attr_out_bytes(await self.ops.getattr(nodeid, ctx))]

    async def _setattr(self, nodeid, body, ctx) -> list:
        (valid, _, fh, size, _, atime, mtime, _, atimens, mtimens, _, mode, _, uid, gid,
         _) = wire.SETATTR_IN.unpack_from(body)
        attr = pyfuse3.EntryAttributes()
        now = time.time_ns()
        attr.st_size, attr.st_mode, attr.st_uid, attr.st_gid = size, mode, uid, gid
        attr.st_atime_ns = now if valid & wire.FATTR_ATIME_NOW else atime * 1_000_000_000 + atimens
        attr.st_mtime_ns = now if valid & wire.FATTR_MTIME_NOW else mtime * 1_000_000_000 + mtimens
        fh = fh if valid & wire.FATTR_FH else None
        return [wire.attr_out_bytes(await self.ops.setattr(nodeid, attr, Fields(valid), fh, ctx))]

    async def _readlink(self, nodeid, body, ctx) -> list:
        return [bytes(await self.ops.readlink(nodeid, ctx))]

    async def _symlink(self, nodeid, body, ctx) -> list:
        name, target = wire.names_in(body, 2)
        return [wire.entry_bytes(await self.ops.symlink(nodeid, name, target, ctx))]

    async def _mknod(self, nodeid, body, ctx) -> list:
        mode, rdev, umask, _ = wire.MKNOD_IN.unpack_from(body)
        name, = wire.names_in(body[wire.MKNOD_IN.size:], 1)
        ctx.umask = umask
        return [wire.entry_bytes(await self.ops.mknod(nodeid, name, mode, rdev, ctx))]

    async def _mkdir(self, nodeid, body, ctx) -> list:
        mode, umask = wire.MKDIR_IN.unpack_from(body)
        name, = wire.names_in(body[wire.MKDIR_IN.size:], 1)
        ctx.umask = umask
        return [wire.entry_bytes(await self.ops.mkdir(nodeid, name, mode, ctx))]

    async def _unlink(self, nodeid, body, ctx) -> list:
        await self.ops.unlink(nodeid, wire.names_in(body, 1)[0], ctx)
        return []

    async def _rmdir(self, nodeid, body, ctx) -> list:
        await self.ops.rmdir(nodeid, wire.names_in(body, 1)[0], ctx)
        return []

    async def _rename(self, nodeid, body, ctx) -> list:
        newdir = wire.RENAME_IN.unpack_from(body)[0]
        old, new = wire.names_in(body[wire.RENAME_IN.size:], 2)
        await self.ops.rename(nodeid, old, newdir, new, 0, ctx)
        return []

    async def _rename2(self, nodeid, body, ctx) -> list:
        newdir, flags, _ = wire.RENAME2_IN.unpack_from(body)
        old, new = wire.names_in(body[wire.RENAME2_IN.size:], 2)
        await self.ops.rename(nodeid, old, newdir, new, flags, ctx)
        return []

    async def _link(self, nodeid, body, ctx) -> list:
        old = wire.LINK_IN.unpack_from(body)[0]
        name, = wire.names_in(body[wire.LINK_IN.size:], 1)
        return [wire.entry_bytes(await self.ops.link(old, nodeid, name, ctx))]

    # ---- files ------------------------------------------------------------------------------
    async def _open(self, nodeid, body, ctx) -> list:
        flags, _ = wire.OPEN_IN.unpack_from(body)
        fi = await self.ops.open(nodeid, flags, ctx)
        return [self._open_out(fi)]

    async def _create(self, nodeid, body, ctx) -> list:
        flags, mode, umask, _ = wire.CREATE_IN.unpack_from(body)
        name, = wire.names_in(body[wire.CREATE_IN.size:], 1)
        ctx.umask = umask
        fi, attr = await self.ops.create(nodeid, name, mode, flags, ctx)
        return [wire.entry_bytes(attr), self._open_out(fi)]

    def _open_out(self, fi) -> bytes:
        flags = ((wire.FOPEN_DIRECT_IO if fi.direct_io else 0) | (wire.FOPEN_KEEP_CACHE if fi.keep_cache else 0)
                 | (wire.FOPEN_NONSEEKABLE if fi.nonseekable else 0))
        backing = self.passthrough.answer(fi.fh)
        if backing is not None:
            backing_id, extra = backing
            return wire.OPEN_OUT.pack(fi.fh, extra, backing_id)
        return wire.OPEN_OUT.pack(fi.fh, flags, 0)

    async def _read(self, nodeid, body, ctx) -> list:
        fh, off, size, *_ = wire.READ_IN.unpack_from(body)
        return [await self.ops.read(fh, off, size)]

    async def _write(self, nodeid, body, ctx) -> list:
        fh, off, size, *_ = wire.WRITE_IN.unpack_from(body)
        data = bytes(body[wire.WRITE_IN.size:wire.WRITE_IN.size + size])
        return [wire.WRITE_OUT.pack(await self.ops.write(fh, off, data), 0)]

    async def _flush(self, nodeid, body, ctx) -> list:
        await self.ops.flush(wire.FLUSH_IN.unpack_from(body)[0])
        return []

    async def _release(self, nodeid, body, ctx) -> list:
        fh = wire.RELEASE_IN.unpack_from(body)[0]
        try:
            await self.ops.release(fh)
        finally:
            self.passthrough.release(fh)
        return []

    async def _fsync(self, nodeid, body, ctx) -> list:
        fh, flags, _ = wire.FSYNC_IN.unpack_from(body)
        await self.ops.fsync(fh, bool(flags & 1))
        return []

    # ---- directories ------------------------------------------------------------------------
    async def _opendir(self, nodeid, body, ctx) -> list:
        fh = await self.ops.opendir(nodeid, ctx)
        return [wire.OPEN_OUT.pack(fh, 0, 0)]

    async def _readdir(self, nodeid, body, ctx, plus: bool = False) -> list:
        fh, off, size, *_ = wire.READ_IN.unpack_from(body)
        token = DirToken(size, plus)
        await self.ops.readdir(fh, off, token)
        return token.parts

    async def _readdirplus(self, nodeid, body, ctx) -> list:
        return await self._readdir(nodeid, body, ctx, plus=True)

    async def _releasedir(self, nodeid, body, ctx) -> list:
        await self.ops.releasedir(wire.RELEASE_IN.unpack_from(body)[0])
        return []

    async def _fsyncdir(self, nodeid, body, ctx) -> list:
        return []

    async def _access(self, nodeid, body, ctx) -> list:
        await self.ops.access(nodeid, wire.GETXATTR_IN.unpack_from(body)[0], ctx)
        return []

    # ---- xattrs and the filesystem ------------------------------------------------------------
    async def _setxattr(self, nodeid, body, ctx) -> list:
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

    async def _getxattr(self, nodeid, body, ctx) -> list:
        size, _ = wire.GETXATTR_IN.unpack_from(body)
        name, = wire.names_in(body[wire.GETXATTR_IN.size:], 1)
        return self._sized(bytes(await self.ops.getxattr(nodeid, name, ctx)), size)

    async def _listxattr(self, nodeid, body, ctx) -> list:
        size, _ = wire.GETXATTR_IN.unpack_from(body)
        names = await self.ops.listxattr(nodeid, ctx)
        return self._sized(b"".join(bytes(n) + b"\0" for n in names), size)

    @staticmethod
    def _sized(value: bytes, size: int) -> list:
        if size == 0:
            return [wire.GETXATTR_OUT.pack(len(value), 0)]
        if len(value) > size:
            raise pyfuse3.FUSEError(errno.ERANGE)
        return [value]

    async def _removexattr(self, nodeid, body, ctx) -> list:
        await self.ops.removexattr(nodeid, wire.names_in(body, 1)[0], ctx)
        return []

    async def _statfs(self, nodeid, body, ctx) -> list:
        s = await self.ops.statfs(ctx)
        return [wire.STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree,
                                     s.f_bsize, s.f_namemax, s.f_frsize, 0)]
