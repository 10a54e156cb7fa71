"""pyfuse3 handlers: each translates one request to the store (kvfs.store.store.Store)."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time

import pyfuse3

from kvfs.errors import NamespaceError
from kvfs.fs import control, dirreply
from kvfs.fs.killpriv import PrivKills
from kvfs.fs.coherence import KernelCaches
from kvfs.fs.opens import Held, Opens, Renewed, Replaced
from kvfs.fs.errmap import translate
from kvfs.protocol import ALIGN, CONTROL_NAME_B, ROOT_INO
from kvfs.quota import XATTR as QUOTA_XATTR, Quotas
from kvfs.store.records import InodeRecord
from kvfs.store.store import Cred, Store

log = logging.getLogger(__name__)

REOPENS = 4         # times a read-only open whose version was replaced meanwhile is opened again

# Names and attributes change only through the kernel, or by the daemon, which tells the kernel
# (eviction and loss: invalidate_entry; a new version: the seal's invalidation), so the kernel may
# keep them long: an older block's stat is then answered by the kernel alone.
ENTRY_TIMEOUT = 3600
ATTR_TIMEOUT = 3600
# A missing name is remembered by the kernel this long (a negative dentry). Safe because every
# name appears through the kernel (create, mkdir, symlink, rename replace the negative dentry);
# the daemon never adds a name on its own while mounted (fsck and rebuild run offline).
NEGATIVE_TIMEOUT = 60


def _negative() -> pyfuse3.EntryAttributes:
    """A lookup answer for a missing name that the kernel caches (st_ino 0; pyfuse3 docs)."""
    a = pyfuse3.EntryAttributes()
    a.st_ino = 0
    a.entry_timeout = NEGATIVE_TIMEOUT
    return a


_NEGATIVE = _negative()    # never changed: pyfuse3 copies the fields into each reply


def _entry(ino: int, rec: InodeRecord) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.generation = 0
    a.entry_timeout = ENTRY_TIMEOUT
    a.attr_timeout = ATTR_TIMEOUT
    a.st_mode = rec.mode
    if stat.S_ISDIR(rec.mode):       # 1: not counted (a directory older than the count)
        a.st_nlink = 2 + rec.subdirs if rec.subdirs is not None else 1
    else:
        a.st_nlink = rec.nlink       # 0 for an unlinked file still open
    a.st_uid = rec.uid
    a.st_gid = rec.gid
    a.st_rdev = 0
    a.st_size = rec.size
    a.st_blksize = 1 << 20
    a.st_blocks = (rec.size + 511) // 512
    a.st_atime_ns = rec.atime
    a.st_mtime_ns = rec.mtime
    a.st_ctime_ns = rec.ctime
    return a


def _parent_ok(parent_inode: int) -> None:
    if control.is_control(parent_inode):
        raise pyfuse3.FUSEError(errno.EPERM)


def _stale(store: Store, inode: int, e: NamespaceError) -> Exception:
    """What to answer a request by a name for an inode that is not there. The daemon drops
    inodes by itself (eviction), and the kernel holds their names until its notification
    lands: ESTALE then, so that the kernel looks the name up again (ENOENT, and the name
    goes; open(O_CREAT) creates the file) instead of answering ENOENT and keeping the
    name, whose cached attributes a later stat(2) would still show. An evicted inode kept
    for a reader of an older version is answered so too (``ns.evicted``): a write open
    would have started an empty buffer on an unlinked inode."""
    if e.errno == errno.ENOENT and store.names.dropped(inode):
        return pyfuse3.FUSEError(errno.ESTALE)
    return e


class KvfsOperations(pyfuse3.Operations):
    enable_writeback_cache = False
    shared = None          # kvfs.remote.share.adopt.SharedNames on a shared remote volume

    def __init__(self, store: Store, describe):
        super().__init__()
        self.store = store
        self.control = control.Control(store, describe)
        self._latency = store.telemetry.latency     # kvfs.telemetry histograms
        self.quotas = Quotas(store)          # kvfs.quota (kvfs.build.build_ops hands it to the store)
        self._ctl: dict[int, control.ControlHandle] = {}
        self.privs = PrivKills(store.files)  # setuid/setgid kills (kvfs/fs/killpriv.py)
        self._next_ctl = 1 << 62
        self.opens = Opens(store)           # how each open is answered (kvfs/fs/opens.py)
        self.kernel = KernelCaches(self.opens)     # the kernel's caches kept true (kvfs/fs/coherence.py)
        self.data_reads = 0                 # READs of files (not control files) that reached us
        store.names.on_names_removed(self.kernel.name_removed)
        self.control.commits.invalidate = self.kernel.invalidate_names

    # ---- names and attributes ----------------------------------------------
    @translate
    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode == ROOT_INO and name == CONTROL_NAME_B:
            return control.attrs(control.CTRL_DIR)
        if parent_inode == control.CTRL_DIR:
            return self.control.lookup(name)
        if name == b".":
            ino = parent_inode
        elif name == b"..":
            ino = self.store.names.inode(parent_inode).parent
        else:
            t0 = time.perf_counter()
            try:
                ino = self.store.names.find(parent_inode, name)     # a miss is common: no exception
                if ino is None and self.shared is not None:
                    # then the other nodes' published blocks; no negative entry (a block
                    # published later must be found)
                    ino = await self.shared.lookup(parent_inode, name)
                    if ino is not None:
                        return _entry(ino, self.store.files.getattr(ino))
                    self._missed(parent_inode)
                    raise pyfuse3.FUSEError(errno.ENOENT)
                if ino is None:
                    self._missed(parent_inode)
                    if NEGATIVE_TIMEOUT > 0:
                        return _NEGATIVE
                    raise pyfuse3.FUSEError(errno.ENOENT)
            finally:
                self._latency["lookup"].observe(time.perf_counter() - t0)
        return _entry(ino, self.store.files.getattr(ino))

    def _missed(self, parent: int) -> None:
        """A name looked up and not found: a miss of its namespace (the top-level directory)."""
        self.store.telemetry.miss_in(self.store.names.top_of(parent))

    @translate
    async def getattr(self, inode, ctx=None):
        if control.is_control(inode):
            return control.attrs(inode)
        try:
            return _entry(inode, self.store.files.getattr(inode))
        except NamespaceError as e:
            raise _stale(self.store, inode, e) from None

    @translate
    async def setattr(self, inode, attr, fields, fh, ctx):
        if control.is_control(inode):
            raise pyfuse3.FUSEError(errno.EPERM)
        if fh is None and self.store.names.evicted(inode):     # by a name (see _stale)
            raise pyfuse3.FUSEError(errno.ESTALE)
        try:
            renew = fh is None and self.shared is None          # by a name: a held file renews
            if fields.update_size and self.quotas.limits:
                await self.quotas.admit_resize(inode, attr.st_size)
            async with (self.opens.changing(inode, renew) if fields.update_size else contextlib.nullcontext()):
                rec = await self.store.files.setattr(
                    inode,
                    size=attr.st_size if fields.update_size else None,
                    mode=attr.st_mode if fields.update_mode else None,
                    uid=attr.st_uid if fields.update_uid else None,
                    gid=attr.st_gid if fields.update_gid else None,
                    atime=attr.st_atime_ns if fields.update_atime else None,
                    mtime=attr.st_mtime_ns if fields.update_mtime else None,
                    kill=self.privs.on_setattr(fields, ctx))
        except NamespaceError as e:
            raise _stale(self.store, inode, e) from None
        except Held:
            raise pyfuse3.FUSEError(errno.ETXTBSY) from None
        except Renewed as r:
            raise self.kernel.renewed(r) from None
        return _entry(inode, rec)

    async def forget(self, inode_list):
        pass

    @translate
    async def readlink(self, inode, ctx):
        rec = self.store.names.inode(inode)
        if not stat.S_ISLNK(rec.mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return rec.target

    @translate
    async def mkdir(self, parent_inode, name, mode, ctx):
        _parent_ok(parent_inode)
        ino, rec = self.store.names.make(parent_inode, name, stat.S_IFDIR | (mode & 0o7777), ctx.uid, ctx.gid)
        return _entry(ino, rec)

    @translate
    async def rmdir(self, parent_inode, name, ctx):
        _parent_ok(parent_inode)
        self.store.names.rmdir(parent_inode, name)

    @translate
    async def unlink(self, parent_inode, name, ctx):
        _parent_ok(parent_inode)
        await self.store.names.unlink(parent_inode, name)

    @translate
    async def symlink(self, parent_inode, name, target, ctx):
        _parent_ok(parent_inode)
        ino, rec = self.store.names.make(parent_inode, name, stat.S_IFLNK | 0o777, ctx.uid, ctx.gid,
                                   target=bytes(target))
        return _entry(ino, rec)

    @translate
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        """A regular file (an empty one, as create + release); FIFOs, sockets and devices:
        EPERM, what mknod(2) gives where the filesystem does not support the type."""
        if not stat.S_ISREG(mode):
            raise pyfuse3.FUSEError(errno.EPERM)
        fi, entry = await self.create(parent_inode, name, mode, os.O_WRONLY, ctx)
        await self.release(fi.fh)
        return entry

    @translate
    async def link(self, inode, new_parent_inode, new_name, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)      # kvfs objects have exactly one name

    @translate
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        _parent_ok(parent_inode_old)
        _parent_ok(parent_inode_new)
        await self.store.names.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    # ---- directories ----------------------------------------------------------
    @translate
    async def opendir(self, inode, ctx):
        if control.is_control(inode):
            return inode
        if not stat.S_ISDIR(self.store.names.inode(inode).mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if self.shared is not None:
            await self.shared.fill(inode)
        return inode

    @translate
    async def readdir(self, fh, start_id, token):
        if fh == control.CTRL_DIR:
            self.control.readdir(start_id, token)
            return
        for eid, name, ino, rec in self.store.names.entries(fh, start_id):
            # the attributes getattr gives (a file being written: its buffer's size), or the
            # kernel would take the sealed size for the inode's
            if not dirreply.reply(token, name, _entry(ino, self.store.files.live_attrs(ino, rec)), eid):
                return

    async def releasedir(self, fh):
        pass

    # ---- files ------------------------------------------------------------------
    @translate
    async def open(self, inode, flags, ctx, kill: bool | None = None):
        """``kill``: the kernel's word that an O_TRUNC takes setuid/setgid away
        (FUSE_OPEN_KILL_SUIDGID, kvfs/fs/killpriv.py); None: the daemon decides."""
        if control.is_control(inode):
            fh = self._next_ctl
            self._next_ctl += 1
            self._ctl[fh] = self.control.open(inode, flags, control.caller(ctx), ctx.pid)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False, nonseekable=False)
        try:
            if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
                async with self.opens.changing(inode, renew=self.shared is None):      # until its write state exists
                    fh = await self.store.files.open(inode, flags)
            else:
                fh = await self.store.files.open(inode, flags)
        except NamespaceError as e:
            raise _stale(self.store, inode, e) from None
        except Held:
            raise pyfuse3.FUSEError(errno.ETXTBSY) from None
        except Renewed as r:
            raise self.kernel.renewed(r) from None
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            await self.privs.on_open(fh, inode, flags, ctx, kill)
        for _ in range(REOPENS):
            try:
                return await self.opens.file_info(fh, inode, flags)
            except Held:
                await self.release(fh)
                raise pyfuse3.FUSEError(errno.ETXTBSY) from None
            except Replaced:
                # the version it chose was replaced while it waited: the current one instead
                # (a read-only handle: nothing of setuid/setgid to carry over)
                await self.release(fh)
                try:
                    fh = await self.store.files.open(inode, flags)
                except NamespaceError as e:
                    raise _stale(self.store, inode, e) from None
        await self.release(fh)
        raise pyfuse3.FUSEError(errno.ETXTBSY)

    @translate
    async def create(self, parent_inode, name, mode, flags, ctx):
        _parent_ok(parent_inode)
        fh, ino, rec = await self.store.files.create(parent_inode, name, mode, ctx.uid, ctx.gid, flags)
        self.privs.on_create(fh, flags, ctx)
        self.opens.created(ino)
        return await self.opens.file_info(fh, ino, flags), _entry(ino, rec)

    @translate
    async def read(self, fh, off, size):
        if fh in self._ctl:
            return await self.control.read(self._ctl[fh], off, size)
        self.data_reads += 1
        if self.opens.unseen:
            self.opens.seen(fh)
        t0 = time.perf_counter()
        try:
            return await self.store.files.read(fh, off, size)
        finally:
            self._latency["read"].observe(time.perf_counter() - t0)

    @translate
    async def write(self, fh, off, buf, kill=None):
        """``kill``: the writer's request context, where the kernel said the write takes
        setuid/setgid away (FUSE_WRITE_KILL_SUIDGID, kvfs/fs/killpriv.py)."""
        if fh in self._ctl:
            return await self.control.write(self._ctl[fh], off, buf)
        self.opens.writing(fh)
        ino = self.store.files.handles[fh].ino
        if self.privs.write_may_kill(ino, kill is not None):
            await self.privs.on_write(fh, ino, kill)
        t0 = time.perf_counter()
        try:
            if self.quotas.limits:
                try:
                    await self.quotas.admit_write(fh, off, len(buf))
                except NamespaceError as e:     # EDQUOT: the file lacks this piece now
                    self.store.files.fail_write(fh, e)
                    raise
            return await self.store.files.write(fh, off, buf)
        finally:
            self._latency["write"].observe(time.perf_counter() - t0)

    @translate
    async def flush(self, fh):
        if fh in self._ctl:
            return
        self.opens.flushed(fh)
        try:
            await self.store.files.flush(fh)
        except NamespaceError:
            # a failed version given up at close may have removed a new file's name: it is
            # out of the kernel's caches before close(2) returns the error
            await self.kernel.synced()
            raise

    @translate
    async def fsync(self, fh, datasync):
        if fh in self._ctl:
            return
        await self.store.files.fsync(fh)

    @translate
    async def release(self, fh):
        h = self._ctl.pop(fh, None)
        if h is not None:
            await self.control.close(h)        # closing a lease descriptor ends its lease
            return
        self.opens.closed(fh)
        self.privs.released(fh)
        h = self.store.files.handles.get(fh)
        try:
            await self.store.files.release(fh)
        finally:
            await self.quotas.settle(fh, h.ino if h is not None else None)

    # ---- xattrs -------------------------------------------------------------
    @translate
    async def getxattr(self, inode, name, ctx):
        if control.is_control(inode):
            raise pyfuse3.FUSEError(errno.ENODATA)
        if name == QUOTA_XATTR:
            return self.quotas.get_xattr(inode)
        value = self.store.xattrs.find(inode, name, Cred(ctx.uid, ctx.gid))
        if value is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return value

    @translate
    async def setxattr(self, inode, name, value, ctx):
        if control.is_control(inode):
            raise pyfuse3.FUSEError(errno.EPERM)
        if name == QUOTA_XATTR:
            return self.quotas.set_xattr(inode, value, ctx.uid)
        self.store.xattrs.set(inode, name, value)

    @translate
    async def listxattr(self, inode, ctx):
        if control.is_control(inode):
            return []
        return self.store.xattrs.names(inode)

    @translate
    async def removexattr(self, inode, name, ctx):
        if control.is_control(inode):
            raise pyfuse3.FUSEError(errno.EPERM)
        self.store.xattrs.remove(inode, name)

    # ---- filesystem ---------------------------------------------------------------
    @translate
    async def statfs(self, ctx):
        total, free = self.store.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = ALIGN
        s.f_blocks = total // ALIGN
        s.f_bfree = s.f_bavail = free // ALIGN
        s.f_files = 1 << 32
        s.f_ffree = s.f_favail = (1 << 32) - self.store.names.inode_count()
        s.f_namemax = 255
        return s

    async def access(self, inode, mode, ctx):
        # Without default_permissions the kernel asks here on every access(2) (vLLM's existence
        # check); ENOSYS once makes it stop asking and allow (the lookup already found the file).
        raise pyfuse3.FUSEError(errno.ENOSYS)
