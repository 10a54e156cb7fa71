"""Files being read and written: handles, the write state shared by a file's writers, and
sealing: the ``files`` member of ``Store`` (kvfs/store/store.py).

A file being written has a WriteState shared by all its writers: a staging
buffer (tmpfs, spilled to NVMe when RAM is full). When the last writer flushes
or releases it, the buffer is sealed into a new immutable object and the inode
is pointed at it in one index transaction. Readers bind to the sealed object
they opened and keep reading it even after a new version is installed.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time
from typing import Awaitable, Callable

import trio

from kvfs.errors import NamespaceError
from kvfs.store.index import Index
from kvfs.store.namespace import Namespace
from kvfs.store.objects import ObjectStore
from kvfs.store.staging import Staging
from kvfs.store.records import InodeRecord
from kvfs.store.sniff import peek_block_header
from kvfs.store.versions import fit, orphan_version
from kvfs.store.writestate import Handle, WriteState, failed_error, write_errno

log = logging.getLogger(__name__)
SUIDGID = stat.S_ISUID | stat.S_ISGID


class FileHandles:
    """Attributes, open/create, read/write/flush/release and sealing. ``grants_follow_setattr``:
    Owners' (a chown/chmod takes back backing-file grants)."""

    def __init__(self, index: Index, store: ObjectStore, ns: Namespace, spill_dir,
                 grants_follow_setattr: Callable[[int, InodeRecord, bool, bool], None]):
        self.index = index
        self.store = store
        self.ns = ns
        self.spill_dir = spill_dir
        self.telemetry = store.telemetry
        self.grants_follow_setattr = grants_follow_setattr
        self.handles: dict[int, Handle] = {}
        self.writers: dict[int, WriteState] = {}
        self.open_count: dict[int, int] = {}
        # ino -> the sizes it had when each truncate of it in flight began (see live_attrs)
        self.resizing: dict[int, list[int]] = {}
        self._next_fh = 1
        self._releasing = 0                  # releases in progress (a seal may be running)
        self.on_content_changed: Callable[[int], None] = lambda ino: None
        # (ino, write state serial, new object id) after a seal; default: content changed
        self.on_sealed: Callable[[int, int, int], None] = lambda ino, serial, oid: self.on_content_changed(ino)
        # (new parent, new name) after a rename: a shared volume republishes the moved block
        self.on_renamed: Callable[[int, bytes], Awaitable[None]] | None = None

    # ---- attributes -----------------------------------------------------------
    def getattr(self, ino: int) -> InodeRecord:
        return self.live_attrs(ino, self.ns.inode(ino))

    def live_attrs(self, ino: int, rec: InodeRecord) -> InodeRecord:
        """``rec`` (the inode's record) with what a write in progress changed: the size of its
        buffer and the mtime of its last write (the record has them once it is sealed).
        Every path that reports attributes to the kernel goes through here (getattr, lookup,
        readdirplus): the kernel keeps one size per inode and trusts the latest answer. A
        changed record is a copy: ``rec`` may be the index's shared one.

        While a truncate of the inode is in flight the size is at most the one it had when the
        truncate began: the kernel keeps that size until the truncate's reply (it ignores
        attributes that come meanwhile, FUSE_I_SIZE_UNSTABLE) and cuts cached reads at it,
        but stat(2) shows the size a GETATTR reply gives; a grown buffer's size there was
        EOF inside fstat's size for a reader (the concurrent probe, one file grown by truncate)."""
        ws = self.writers.get(ino)
        resizing = self.resizing.get(ino)
        if ws is not None and (ws.staging is not None or ws.mtime is not None) or resizing:
            rec = rec.copy()
            if ws is not None and ws.staging is not None:
                rec.size = ws.staging.size
            if ws is not None and ws.mtime is not None:
                rec.mtime = ws.mtime
            if resizing:
                rec.size = min(rec.size, *resizing)
        return rec

    def live_size(self, ino: int, rec: InodeRecord) -> int:
        """``live_attrs(ino, rec).size`` without a copy (every read asks it)."""
        ws = self.writers.get(ino)
        return rec.size if ws is None or ws.staging is None else ws.staging.size

    def is_open(self, ino: int) -> bool:
        return self.open_count.get(ino, 0) > 0

    def dirty(self, ino: int) -> bool:
        """``ino`` has a write in progress not sealed yet (its bytes are in RAM's buffer)."""
        ws = self.writers.get(ino)
        return ws is not None and ws.dirty

    def open_handles(self) -> int:
        """Handles open, and those whose release (and its seal) is still running."""
        return len(self.handles) + self._releasing

    def max_file_size(self) -> int:
        """The largest tier's capacity: no tier could ever hold a larger file (EFBIG). While a
        tier's capacity is not known yet (a remote tier down since the mount) there is no limit:
        that tier may be the largest, and its size is only known once it is reached."""
        if not all(t.sized for t in self.store.tiers):
            return (1 << 63) - 1
        return max(t.capacity for t in self.store.tiers)

    async def setattr(self, ino: int, *, size=None, mode=None, uid=None, gid=None,
                      atime=None, mtime=None, kill=None) -> InodeRecord:
        """``kill``: the change takes setuid/setgid away (a truncate by a caller without
        CAP_FSETID, a chown): ``kill(mode, gid)`` is the mode kept (kvfs/fs/killpriv.py),
        applied with the other fields in one transaction, before the size changes."""
        rec = self.ns.inode(ino)
        fields = {}
        if mode is not None:
            fields["mode"] = (rec.mode & ~0o7777) | (mode & 0o7777)
        if kill is not None and rec.mode & SUIDGID and stat.S_ISREG(rec.mode):
            before = fields.get("mode", rec.mode)
            kept = kill(before, rec.gid)
            if kept != before:
                fields["mode"] = kept
        if uid is not None:
            fields["uid"] = uid
        if gid is not None:
            fields["gid"] = gid
        if atime is not None:
            fields["atime"] = atime
        if mtime is not None:
            fields["mtime"] = mtime
        if fields:
            rec = self.ns.update(ino, **fields)
            self.grants_follow_setattr(ino, rec, uid is not None or gid is not None, "mode" in fields)
            ws = self.writers.get(ino)
            if mtime is not None and ws is not None:
                ws.mtime, ws.created = mtime, 0     # set after the last write: the seal keeps it
        if size is not None:
            if not stat.S_ISREG(rec.mode):
                raise NamespaceError(errno.EISDIR if stat.S_ISDIR(rec.mode) else errno.EINVAL)
            if size > self.max_file_size():
                raise NamespaceError(errno.EFBIG, "larger than the largest tier")
            before = self.live_size(ino, rec)
            sizes = self.resizing.setdefault(ino, [])
            sizes.append(before)
            try:
                await self._resize(ino, size, mtime)
            finally:
                sizes.remove(before)
                if not sizes:
                    del self.resizing[ino]
        return self.getattr(ino)

    async def _resize(self, ino: int, size: int, mtime: int | None) -> None:
        """The size change of :meth:`setattr`."""
        ws = await self._live_writer(ino, writing=True)
        if ws is not None:
            ws.handles += 1                      # held: its writers may release meanwhile
            ws.owners += 1
            try:
                staging = await self.staging_of(ws)
                ws.changes += 1                  # (a seal by a writer's flush waits for it)
                try:
                    await staging.truncate(size)
                finally:
                    ws.change_ended()
                if size == 0:                    # every byte rewritten: a failed write is gone
                    ws.failed = None
                ws.dirty = True
                ws.touch()
                if mtime is not None:
                    ws.mtime = mtime
                if ws.writers == 0:              # they did: nobody else will seal this
                    await self._seal(ws)
                else:
                    self.ns.update(ino)          # ctime now (the seal sets it later too)
            finally:
                with trio.CancelScope(shield=True):
                    await self._end(ws, owner=True)
        else:
            ws = await self._begin_write(ino, truncate=size == 0)
            ws.handles += 1
            ws.owners += 1
            try:
                await (await self.staging_of(ws)).truncate(size)
                ws.dirty = True
                ws.mtime = mtime if mtime is not None else time.time_ns()
                await self._seal(ws)
            finally:
                with trio.CancelScope(shield=True):
                    await self._end(ws, owner=True)

    # ---- opening --------------------------------------------------------------
    def _new_fh(self, h: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = h
        self.open_count[h.ino] = self.open_count.get(h.ino, 0) + 1
        return fh

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                     flags: int = os.O_RDWR) -> tuple[int, int, InodeRecord]:
        ino, rec = self.ns.make(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid, oid=None)
        ws = WriteState(ino, staging=self.store.ram.new_staging(), dirty=True,
                        mtime=rec.mtime, created=rec.mtime)
        ws.ready.set()
        self.writers[ino] = ws
        ws.handles = ws.owners = 1
        if flags & os.O_ACCMODE == os.O_RDONLY:
            # O_RDONLY|O_CREAT: an empty file, sealed now; the descriptor only reads
            try:
                await self._seal(ws)
            except BaseException:
                self._abandon(ws)
                raise
            finally:
                await self._end(ws, owner=True)
            return await self.open(ino, flags), ino, self.getattr(ino)
        ws.writers = 1
        return self._new_fh(Handle(ino, write=True, append=bool(flags & os.O_APPEND), ws=ws)), ino, rec

    async def open(self, ino: int, flags: int) -> int:
        acc = flags & os.O_ACCMODE
        if ino in self.ns.evicted and (acc != os.O_RDONLY or flags & os.O_TRUNC):
            # kept for the descriptors opened before it went: a change must reach the name's
            # inode (ESTALE: the kernel looks the name up again). A read-only open of it came
            # through a dentry looked up before a rename over the name or a renewal: it reads
            # the version that name had then, as an open racing a rename does on any filesystem
            raise NamespaceError(errno.ENOENT)
        ws = await self._live_writer(ino, writing=acc != os.O_RDONLY)
        rec = self.ns.inode(ino)         # after any wait: a seal may have installed a new version
        if stat.S_ISDIR(rec.mode):
            raise NamespaceError(errno.EISDIR)
        if acc != os.O_RDONLY:
            joined = ws is not None
            if not joined:
                ws = await self._begin_write(ino, truncate=bool(flags & os.O_TRUNC))
            ws.writers += 1              # joined before any wait: the state cannot end now
            ws.owners += 1
            ws.handles += 1
            if joined and flags & os.O_TRUNC:
                try:
                    staging = await self.staging_of(ws)
                    ws.changes += 1
                    try:
                        await staging.truncate(0)
                    finally:
                        ws.change_ended()
                except BaseException:
                    with trio.CancelScope(shield=True):
                        ws.writers -= 1
                        await self._end(ws, owner=True)
                    raise
                ws.failed = None            # the whole buffer is rewritten (see setattr)
                ws.dirty = True
                ws.touch()
            return self._new_fh(Handle(ino, write=True, append=bool(flags & os.O_APPEND), ws=ws))
        if ws is not None:
            ws.handles += 1
            return self._new_fh(Handle(ino, ws=ws))
        obj = self.store.objs.get(rec.oid)
        if obj is None and ino in self.ns.orphans:
            # an orphan's version that no name holds any more is only in its readers' handles
            # (an open through a name the kernel looked up before the name moved: rare)
            obj = next((h.obj for h in self.handles.values()
                        if h.ino == ino and h.obj is not None and h.obj.oid == rec.oid), None)
        if obj is None:
            raise NamespaceError(errno.ENOENT)
        obj.refs += 1
        self.store.note_open(obj)
        return self._new_fh(Handle(ino, obj=obj))

    async def _live_writer(self, ino: int, writing: bool) -> WriteState | None:
        """The write state of ``ino`` a new handle joins (once it is ready), or None. Checked
        again after every wait (a release may end the state meanwhile: a handle must never join
        an ended one, its buffer and base are gone). A state whose last writer's release is
        sealing it (a writer that never flushed, or whose flush could not seal because another
        writer was open) has no writers: a reader joins it at once and reads the version being
        sealed, a writer (or a truncate) waits until it is gone and starts the next version,
        so that reader keeps its version whichever of them the daemon runs first."""
        while True:
            ws = self.writers.get(ino)
            if ws is None:
                return None
            if not ws.ready.is_set():
                await ws.ready.wait()
            elif writing and ws.writers == 0:
                await ws.gone.wait()
            else:
                return ws

    async def _begin_write(self, ino: int, truncate: bool) -> WriteState:
        rec = self.ns.inode(ino)
        base = self.store.objs.get(rec.oid)
        ws = WriteState(ino, base=base, dirty=truncate)
        if base is not None:
            base.refs += 1
        self.writers[ino] = ws
        try:
            if truncate or base is None:
                ws.staging = self.store.ram.new_staging()
        finally:
            ws.ready.set()
        return ws

    async def staging_of(self, ws: WriteState) -> Staging:
        """The write buffer, materialised from the sealed base on first need. Waits while
        the buffer is being sealed (a change now would be lost, or start from the old base)."""
        while ws.sealing is not None:
            await ws.sealing.wait()
        if ws.staging is None:
            staging = self.store.ram.new_staging()
            try:
                if ws.base is not None and ws.base.size:
                    await staging.fill_from(await self.store.reads.read_all(ws.base))
            except BaseException:
                staging.discard()
                raise
            if ws.staging is None:
                ws.staging = staging
            else:
                staging.discard()
        return ws.staging

    # ---- data ---------------------------------------------------------------
    async def read(self, fh: int, offset: int, size: int):
        """The handle's bytes, fitted to the size the kernel reports for the inode (an older
        version's handle: zeros past its end, EOF at the current size; kvfs/store/versions.py)."""
        h = self.handles[fh]
        data, n = await self._content(h, offset, size)
        return await self._fitted(h, offset, size, data, n)

    async def _content(self, h: Handle, offset: int, size: int):
        """What the handle's content holds at ``offset`` (at most ``size`` bytes), and its size."""
        if h.ws is not None:
            ws = h.ws
            staging = ws.staging
            if staging is not None:
                data = await staging.read(offset, size)
                return data, staging.size
            if ws.base is None:
                return b"", 0
            return await self.store.reads.read(ws.base, offset, size), ws.base.size
        return await self.store.reads.read(h.obj, offset, size), h.obj.size

    async def _fitted(self, h: Handle, offset: int, size: int, data, n: int):
        """``data`` (read from the handle's content before an await) fitted to the inode's size
        now. Only an older version is padded with zeros: the current one may have grown while
        its bytes were read (a write through another descriptor), so what it lacks is read
        again, and it is only ever cut at the current size."""
        try:
            rec = self.ns.inode(h.ino)
        except NamespaceError:
            return fit(data, offset, size, n, None)
        cur = self.live_size(h.ino, rec)
        if not self._current(h, rec):
            return fit(data, offset, size, n, cur)
        want = min(offset + size, cur) - offset
        while 0 <= len(data) < want:
            more, _ = await self._content(h, offset + len(data), want - len(data))
            if not len(more):
                break
            data = bytes(data) + bytes(more)
        return data[:max(want, 0)]

    def _current(self, h: Handle, rec: InodeRecord) -> bool:
        """Whether the handle reads the inode's current version: its live write state, or
        (no buffer in the live one) its sealed object."""
        live = self.writers.get(h.ino)
        if h.ws is not None:
            if live is h.ws:
                return True
            if h.ws.staging is not None:
                return False
            obj = h.ws.base
        else:
            obj = h.obj
        if live is not None and live.staging is not None:
            return False
        return obj is not None and rec.oid == obj.oid

    def fail_write(self, fh: int, e: BaseException) -> None:
        """A piece of a write through ``fh`` was refused or lost (EFBIG, EDQUOT, ENOSPC, EIO):
        the buffer lacks those bytes, so this version is never sealed: close answers the same
        error, a new file is removed and an existing one keeps its last sealed version (never
        a shorter file with a valid checksum)."""
        h = self.handles.get(fh)
        ws = h.ws if h is not None else None
        if ws is None:
            return
        if ws.failed is None:
            ws.failed = f"{type(e).__name__}: {e}"
            ws.failed_errno = write_errno(e)
        ws.dirty = True                     # close seals, and so reports it

    async def write(self, fh: int, offset: int, data) -> int:
        h = self.handles[fh]
        if not h.write:
            raise NamespaceError(errno.EBADF)
        ws = h.ws
        if offset + (len(data) if type(data) is bytes else memoryview(data).nbytes) > self.max_file_size():
            # before a buffer grows toward it (and a seal evicts for it)
            e = NamespaceError(errno.EFBIG, "larger than the largest tier")
            self.fail_write(fh, e)
            raise e
        staging = await self.staging_of(ws)
        ws.changes += 1                     # (a seal waits for it)
        try:
            if h.append:
                offset = staging.size
            try:
                n = await staging.write(offset, data)
            except Exception as e:          # the buffer may lack bytes: sealing it would keep them lost
                self.fail_write(fh, e)
                raise
            await self.written(ws, staging)
        finally:
            ws.change_ended()
        return n

    async def written(self, ws: WriteState, staging) -> None:
        """After bytes reach a write buffer: the file is dirty; RAM over its budget spills
        this buffer to NVMe, RAM past the high watermark wakes the mover."""
        ws.dirty = True
        ws.touch()
        ram = self.store.ram
        if ram.used > ram.capacity and not staging.spilled:
            self.store.kick()
            await staging.spill(self.spill_dir)
        elif ram.used > ram.capacity * self.store.policy.high:
            self.store.kick()

    async def flush(self, fh: int, closing: bool = True) -> None:
        """close(2): seal now if this is the only writer, so errors reach the caller. A version
        whose write failed is given up here (``closing``: not for fsync): when close returns
        its error, a new file is already gone and an existing one back to its sealed version
        (the RELEASE that would do it comes after close returned)."""
        h = self.handles[fh]
        if h.write and h.ws.dirty and h.ws.writers == 1:
            try:
                await self._seal(h.ws)
            except NamespaceError:
                if closing and h.ws.failed and h.ws.dirty:
                    self._abandon(h.ws)
                raise

    async def fsync(self, fh: int) -> None:
        """fsync(2): seal (as close does), then the index record is committed and on disk."""
        await self.flush(fh, closing=False)
        self.index.commit()
        await trio.to_thread.run_sync(self.index.sync)

    async def release(self, fh: int) -> None:
        self._releasing += 1            # still counted in open_handles until its seal is done
        try:
            await self._release(self.handles.pop(fh))
        finally:
            self._releasing -= 1

    async def _release(self, h: Handle) -> None:
        n = self.open_count.get(h.ino, 1) - 1
        if n:
            self.open_count[h.ino] = n
        else:
            self.open_count.pop(h.ino, None)
            self.ns.orphans.pop(h.ino, None)
            self.ns.evicted.discard(h.ino)
        if h.ws is not None:
            ws = h.ws
            if h.write:
                ws.writers -= 1
                if ws.writers == 0 and ws.dirty:
                    try:
                        await self._seal(ws)
                    except Exception as e:
                        log.error("sealing %s failed at release: %s", self.ns.path_of(ws.ino), e)
                        self._abandon(ws)
            await self._end(ws, owner=h.write)
        else:
            h.obj.refs -= 1
            await self.store.release_space(h.obj)

    def _abandon(self, ws: WriteState) -> None:
        """The last writer left and the new version could not be sealed: the inode keeps its
        last sealed version, and the kernel, which was told the writes' size, must forget it
        (else ``stat`` kept the failed size and reads inside it gave EOF)."""
        ws.dirty = False
        self.on_content_changed(ws.ino)
        rec = self.index.get_inode(ws.ino)
        if rec is not None and rec.oid is None:
            # never sealed: it must not stay visible as an empty file
            try:
                self.ns.unlink(rec.parent, rec.name, self.is_open)
            except NamespaceError:
                pass

    async def _end(self, ws: WriteState, owner: bool = False) -> None:
        """A holder of ``ws`` is done: an ``owner`` (a writer or a truncate, see
        WriteState.owners) or a reader."""
        ws.handles -= 1
        if owner:
            ws.owners -= 1
        if ws.owners == 0 and self.writers.get(ws.ino) is ws:
            del self.writers[ws.ino]
            ws.gone.set()
        if ws.handles == 0:
            if ws.staging is not None:
                ws.staging.discard()
                ws.staging = None
            if not self.writers:             # no write going on: no spare buffer waits for one
                self.store.ram.drop_spares()
            if ws.base is not None:
                ws.base.refs -= 1
                await self.store.release_space(ws.base)
                ws.base = None

    async def _seal(self, ws: WriteState) -> None:
        while ws.sealing is not None:        # one seal of a buffer at a time
            await ws.sealing.wait()
        if not ws.dirty:
            return
        if ws.failed:                        # close answers the error; a never-sealed file goes
            raise failed_error(ws)
        staging = await self.staging_of(ws)
        # until the new object is installed, writes and truncates of this file wait (they
        # would change a buffer being hashed, or start over from the old version); reads
        # keep reading the buffer. Those already in flight end first.
        done = ws.sealing = trio.Event()
        t0 = time.perf_counter()
        try:
            await ws.wait_quiet()
            if ws.failed:
                raise failed_error(ws)
            rec = self.index.get_inode(ws.ino)
            if rec is None:                  # unlinked while open: nothing to keep
                orphan_version(self.ns.orphans, ws.ino, staging.size, ws.mtime, None)
                ws.dirty = False
                return
            kv = await peek_block_header(staging)
            key, renames = self.ns.path_of(ws.ino), self.ns.renames
            obj = await self.store.create(ws.ino, staging, key, rec.gen + 1)
            ws.staging = None
            staging.discard()                # what adopt did not take (a spilled file, empty)
            kvrec = None
            if kv:
                kvrec = {k: str(kv.get(k, "")) for k in ("namespace", "hash", "parent", "tokens")}
            old, installed = self.ns.install(ws.ino, obj, kvrec, mtime=ws.mtime)
            ws.dirty = False
            obj.refs += 1
            prev, ws.base = ws.base, obj     # before any wait: readers of the state read obj now
            if not installed:
                # unlinked or replaced while the buffer was hashed: the object (dropped, kept by
                # the state's reference) is what its writers and joined readers read on, and
                # the new base of the writers' next buffer
                orphan_version(self.ns.orphans, ws.ino, obj.size, ws.mtime, obj.oid)
                if prev is not None:
                    prev.refs -= 1
                    await self.store.release_space(prev)
                return
            path = key if self.ns.renames == renames else self.ns.path_of(ws.ino)
            if self.on_renamed is not None and path != key:
                # renamed while sealing (a rename does not wait for the seal): a copy already on
                # a shared volume was published under the old name
                now = self.index.get_inode(ws.ino)
                if now is not None:
                    await self.on_renamed(now.parent, now.name)
                path = self.ns.path_of(ws.ino)
            if old is not None:
                self.telemetry.events.emit("removed", old, None, path=path, kv=rec.kv)
                await self.store.release_space(old)
            if prev is not None:
                prev.refs -= 1
                await self.store.release_space(prev)
            self.telemetry.latency["seal"].observe(time.perf_counter() - t0)
            self.telemetry.events.emit("stored", obj, self.store.top_tier(obj), path=path, kv=kvrec or {})
        finally:
            ws.sealing = None
            done.set()
        self.on_sealed(ws.ino, ws.serial, obj.oid)
