"""The store's one entry point for the filesystem: files, handles, writes and sealing.

A file being written has a WriteState shared by all its writers: a staging
buffer (tmpfs, spilled to NVMe when RAM is full). When the last writer flushes
or releases it, the buffer is sealed into a new immutable object and the inode
is pointed at it in one index transaction. Readers bind to the sealed object
they opened and keep reading it even after a new version is installed.
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import os
import stat
import time
from typing import Callable

import trio

from kvfs.errors import NamespaceError
from kvfs.protocol import LEASE_TTL, LEASE_TTL_MAX, encode_lease_entry
from kvfs.store import checksum
from kvfs.store.index import ROOT_INO, Index
from kvfs.store.namespace import Namespace
from kvfs.store.objects import Obj, ObjectStore
from kvfs.store.ram import Staging
from kvfs.store.tier import Tier

log = logging.getLogger(__name__)

KV_PREFIX = b"user.kvfs."
XATTR_MAX = 64 * 1024
_HEADER_PEEK = 1 << 20      # the largest block header we parse
LEASE_TTL_MAX_USER = 60.0   # ... for a caller other than root
LEASES_PER_USER = 64        # live leases one non-root uid may hold (its oldest goes first)
LEASE_PIN_SHARE = 4         # a non-root uid pins at most 1/4 of the RAM tier's capacity
_LEASE_ENTRY_MEMO = 1 << 17  # lease entries remembered (JSON text per object and placement)
CREATE_MTIME_SLACK = 1_000_000_000   # ns: writes this soon after create() keep its mtime


@dataclasses.dataclass(frozen=True)
class Cred:
    """Who asks (the FUSE request's uid and gid, and the caller's supplementary groups)."""

    uid: int
    gid: int
    groups: frozenset = frozenset()

    def may(self, rec: dict, want: int) -> bool:
        """``default_permissions`` rules: owner, then group, then other bits (root passes)."""
        if self.uid == 0:
            return True
        mode = rec["mode"]
        if rec["uid"] == self.uid:
            bits = mode >> 6
        elif rec["gid"] == self.gid or rec["gid"] in self.groups:
            bits = mode >> 3
        else:
            bits = mode
        return bits & want == want


ROOT = Cred(0, 0)


@dataclasses.dataclass(eq=False)
class Lease:
    """Objects held for a fast-path reader (their refs count, like open handles)."""

    id: int
    objs: list
    expires: float
    uid: int = 0
    pinned: int = 0             # bytes held


@dataclasses.dataclass(eq=False)
class WriteState:
    ino: int
    staging: Staging | None = None
    base: Obj | None = None         # the sealed version the buffer started from / became
    writers: int = 0
    handles: int = 0
    dirty: bool = False
    sealing: trio.Event | None = None   # set while the buffer is being sealed: writes wait
    ready: trio.Event = dataclasses.field(default_factory=trio.Event)
    serial: int = dataclasses.field(default_factory=itertools.count(1).__next__)
    # the mtime reported while writing and recorded by the seal (None: the seal's time): of the
    # last write, or one set by utimens after it. A file created and written within
    # CREATE_MTIME_SLACK keeps its creation time: the kernel got that in the create reply, and
    # a different mtime later would make it drop the cached pages.
    mtime: int | None = None
    created: int = 0

    def touch(self) -> None:
        """A write or truncate changed the buffer now."""
        now = time.time_ns()
        if now - self.created > CREATE_MTIME_SLACK:
            self.mtime = now


@dataclasses.dataclass(eq=False)
class Handle:
    ino: int
    write: bool = False
    append: bool = False            # writes go to the end of the buffer (see KvfsOperations)
    ws: WriteState | None = None    # writers and readers of a file being written
    obj: Obj | None = None          # readers of a sealed version

    def content_key(self) -> tuple[str, int]:
        """What this handle reads: a sealed object, or one write state's buffer."""
        return ("obj", self.obj.oid) if self.obj is not None else ("ws", self.ws.serial)


def _kv_header(data: bytes) -> dict | None:
    try:
        from kvfs.kv.format import parse_block_header
    except ImportError:
        return None
    try:
        return parse_block_header(data)
    except Exception:
        return None


class Cache:
    def __init__(self, index: Index, store: ObjectStore, spill_dir):
        self.index = index
        self.store = store
        self.ns = Namespace(index, store)
        self.spill_dir = spill_dir
        self.handles: dict[int, Handle] = {}
        self.writers: dict[int, WriteState] = {}
        self.open_count: dict[int, int] = {}
        self._next_fh = 1
        self.on_content_changed: Callable[[int], None] = lambda ino: None
        # (ino, write state serial, new object id) after a seal; default: content changed
        self.on_sealed: Callable[[int, int, int], None] = lambda ino, serial, oid: self.on_content_changed(ino)
        self.leases: dict[int, Lease] = {}
        self._next_lease = 1
        self._lease_entries: dict[int, tuple[str, bytes, str]] = {}    # see lease_entry
        self._released: list[Obj] = []       # objects of leases dropped in sync code
        self._releasing = 0                  # releases in progress (a seal may be running)
        self.telemetry = store.telemetry
        self.telemetry.events.describe = self._describe

    # ---- startup ------------------------------------------------------------
    async def start(self) -> dict[str, int]:
        """Load the object table and recover the namespace after a restart or crash."""
        lost = self.store.load()
        counts, unowned = self.ns.recover(lost)
        for obj in unowned:
            await self.store.release_space(obj)
        if any(counts.values()):
            log.info("recovery: %s", counts)
        return counts

    async def sweep_orphans(self) -> int:
        """Delete backing objects on durable tiers that the index does not know."""
        n = 0
        for tier in self.store.tiers[1:]:
            if not tier.available:
                continue
            async for oid, loc, size in tier.scan():
                if oid not in self.store.objs:
                    self.index.commit()     # a record dropped in memory is gone from LMDB too
                    await tier.delete(oid, loc)
                    n += 1
        if n:
            log.info("removed %d orphaned backing objects", n)
        return n

    # ---- attributes -----------------------------------------------------------
    def getattr(self, ino: int) -> dict:
        return self.live_attrs(ino, self.ns.inode(ino))

    def live_attrs(self, ino: int, rec: dict) -> dict:
        """``rec`` (the inode's record) with what a write in progress changed: the size of its
        buffer and the mtime of its last write (the record has them once it is sealed).
        Every path that reports attributes to the kernel goes through here (getattr, lookup,
        readdirplus): the kernel keeps one size per inode and trusts the latest answer."""
        ws = self.writers.get(ino)
        if ws is not None:
            over = {}
            if ws.staging is not None:
                over["size"] = ws.staging.size
            if ws.mtime is not None:
                over["mtime"] = ws.mtime
            if over:
                rec = dict(rec, **over)
        return rec

    def is_open(self, ino: int) -> bool:
        return self.open_count.get(ino, 0) > 0

    async def setattr(self, ino: int, *, size=None, mode=None, uid=None, gid=None,
                      atime=None, mtime=None) -> dict:
        rec = self.ns.inode(ino)
        fields = {}
        if mode is not None:
            fields["mode"] = (rec["mode"] & ~0o7777) | (mode & 0o7777)
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
            ws = self.writers.get(ino)
            if mtime is not None and ws is not None:
                ws.mtime, ws.created = mtime, 0     # set after the last write: the seal keeps it
        if size is not None:
            if not stat.S_ISREG(rec["mode"]):
                raise NamespaceError(errno.EISDIR if stat.S_ISDIR(rec["mode"]) else errno.EINVAL)
            ws = self.writers.get(ino)
            if ws is not None:
                await (await self._staging(ws)).truncate(size)
                ws.dirty = True
                ws.touch()
                if mtime is not None:
                    ws.mtime = mtime
            else:
                ws = await self._begin_write(ino, truncate=size == 0)
                ws.handles += 1
                try:
                    await (await self._staging(ws)).truncate(size)
                    ws.dirty = True
                    ws.mtime = mtime if mtime is not None else time.time_ns()
                    await self._seal(ws)
                finally:
                    await self._end(ws)
        return self.getattr(ino)

    # ---- opening --------------------------------------------------------------
    def _new_fh(self, h: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = h
        self.open_count[h.ino] = self.open_count.get(h.ino, 0) + 1
        return fh

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                     flags: int = os.O_RDWR) -> tuple[int, int, dict]:
        ino, rec = self.ns.make(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid, oid=None)
        ws = WriteState(ino, staging=self.store.ram.new_staging(), dirty=True,
                        mtime=rec["mtime"], created=rec["mtime"])
        ws.ready.set()
        self.writers[ino] = ws
        ws.handles = 1
        if flags & os.O_ACCMODE == os.O_RDONLY:
            # O_RDONLY|O_CREAT: an empty file, sealed now; the descriptor only reads
            try:
                await self._seal(ws)
            except BaseException:
                self._abandon(ws)
                raise
            finally:
                await self._end(ws)
            return await self.open(ino, flags), ino, self.getattr(ino)
        ws.writers = 1
        return self._new_fh(Handle(ino, write=True, append=bool(flags & os.O_APPEND), ws=ws)), ino, rec

    async def open(self, ino: int, flags: int) -> int:
        rec = self.ns.inode(ino)
        if stat.S_ISDIR(rec["mode"]):
            raise NamespaceError(errno.EISDIR)
        acc = flags & os.O_ACCMODE
        if acc != os.O_RDONLY:
            ws = self.writers.get(ino)
            if ws is None:
                ws = await self._begin_write(ino, truncate=bool(flags & os.O_TRUNC))
            else:
                await ws.ready.wait()
                if flags & os.O_TRUNC:
                    await (await self._staging(ws)).truncate(0)
                    ws.dirty = True
                    ws.touch()
            ws.writers += 1
            ws.handles += 1
            return self._new_fh(Handle(ino, write=True, append=bool(flags & os.O_APPEND), ws=ws))
        ws = self.writers.get(ino)
        if ws is not None:
            await ws.ready.wait()
            ws.handles += 1
            return self._new_fh(Handle(ino, ws=ws))
        obj = self.store.objs.get(rec.get("oid"))
        if obj is None:
            raise NamespaceError(errno.ENOENT)
        obj.refs += 1
        self.store.note_open(obj)
        return self._new_fh(Handle(ino, obj=obj))

    async def _begin_write(self, ino: int, truncate: bool) -> WriteState:
        rec = self.ns.inode(ino)
        base = self.store.objs.get(rec.get("oid"))
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

    async def _staging(self, ws: WriteState) -> Staging:
        """The write buffer, materialised from the sealed base on first need. Waits while
        the buffer is being sealed (a change now would be lost, or start from the old base)."""
        while ws.sealing is not None:
            await ws.sealing.wait()
        if ws.staging is None:
            staging = self.store.ram.new_staging()
            try:
                if ws.base is not None and ws.base.size:
                    await staging.fill_from(await self.store.read_all(ws.base))
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
        h = self.handles[fh]
        if h.ws is not None:
            ws = h.ws
            if ws.staging is not None:
                return await ws.staging.read(offset, size)
            if ws.base is None:
                return b""
            return await self.store.read(ws.base, offset, size)
        return await self.store.read(h.obj, offset, size)

    async def write(self, fh: int, offset: int, data) -> int:
        h = self.handles[fh]
        if not h.write:
            raise NamespaceError(errno.EBADF)
        ws = h.ws
        staging = await self._staging(ws)
        if h.append:
            offset = staging.size
        n = await staging.write(offset, data)
        ws.dirty = True
        ws.touch()
        ram = self.store.ram
        if ram.used > ram.capacity and not staging.spilled:
            self.store.kick()
            await staging.spill(self.spill_dir)
        elif ram.used > ram.capacity * self.store.high:
            self.store.kick()
        return n

    async def flush(self, fh: int) -> None:
        """close(2): seal now if this is the only writer, so errors reach the caller."""
        h = self.handles[fh]
        if h.write and h.ws.dirty and h.ws.writers == 1:
            await self._seal(h.ws)

    async def fsync(self, fh: int) -> None:
        """fsync(2): seal (as close does), then the index record is committed and on disk."""
        await self.flush(fh)
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
            await self._end(ws)
        else:
            h.obj.refs -= 1
            await self.store.release_space(h.obj)

    def _abandon(self, ws: WriteState) -> None:
        """The last writer left and the new version could not be sealed."""
        ws.dirty = False
        rec = self.index.get_inode(ws.ino)
        if rec is not None and rec.get("oid") is None:
            # never sealed: it must not stay visible as an empty file
            try:
                self.ns.unlink(rec["parent"], rec["name"], self.is_open)
            except NamespaceError:
                pass

    async def _end(self, ws: WriteState) -> None:
        ws.handles -= 1
        if ws.writers == 0 and self.writers.get(ws.ino) is ws:
            del self.writers[ws.ino]
        if ws.handles == 0:
            if ws.staging is not None:
                ws.staging.discard()
                ws.staging = None
            if ws.base is not None:
                ws.base.refs -= 1
                await self.store.release_space(ws.base)
                ws.base = None

    async def _peek_block_header(self, staging: Staging) -> dict | None:
        """The kvfs block header of the buffer, if it is one (by content, not by name:
        runtimes write blocks under temporary names and rename them)."""
        if staging.size < 16:
            return None
        first = await staging.read(0, 8)
        n = int.from_bytes(first, "little") + 8
        if n > min(staging.size, _HEADER_PEEK) or not (await staging.read(8, 1)) == b"{":
            return None
        return _kv_header(await staging.read(0, n))

    async def _seal(self, ws: WriteState) -> None:
        while ws.sealing is not None:        # one seal of a buffer at a time
            await ws.sealing.wait()
        if not ws.dirty:
            return
        staging = await self._staging(ws)
        rec = self.index.get_inode(ws.ino)
        if rec is None:                      # unlinked while open: nothing to keep
            orphan = self.ns.orphans.get(ws.ino)
            if orphan is not None:           # its readers still see its size (POSIX)
                orphan["size"] = staging.size
                orphan["mtime"] = ws.mtime or orphan["mtime"]
            ws.dirty = False
            return
        # until the new object is installed, writes and truncates of this file wait (they
        # would change a buffer being hashed, or start over from the old version); reads
        # keep reading the buffer
        done = ws.sealing = trio.Event()
        t0 = time.perf_counter()
        try:
            kv = await self._peek_block_header(staging)
            key = self.ns.path_of(ws.ino)
            obj = await self.store.create(ws.ino, staging, key, rec.get("gen", 0) + 1)
            ws.staging = None
            if staging.fd >= 0:
                staging.discard()
            kvrec = None
            if kv:
                kvrec = {k: str(kv.get(k, "")) for k in ("namespace", "hash", "parent", "tokens")}
            old, installed = self.ns.install(ws.ino, obj, kvrec, mtime=ws.mtime)
            ws.dirty = False
            if old is not None:
                self.telemetry.events.emit("removed", old, None, path=key, kv=rec.get("kv"))
                await self.store.release_space(old)
            if not installed:
                await self.store.release_space(obj)
                return
            obj.refs += 1
            if ws.base is not None:
                ws.base.refs -= 1
                await self.store.release_space(ws.base)
            ws.base = obj
            self.telemetry.latency["seal"].observe(time.perf_counter() - t0)
            self.telemetry.events.emit("stored", obj, self.store.top_tier(obj), path=key, kv=kvrec or {})
        finally:
            ws.sealing = None
            done.set()
        self.on_sealed(ws.ino, ws.serial, obj.oid)

    # ---- namespace pass-throughs that free bytes ---------------------------
    async def unlink(self, parent: int, name: bytes) -> None:
        gone = self._describe_name(parent, name)
        obj = self.ns.unlink(parent, name, self.is_open)
        if obj is not None:
            self._removed(obj, gone)
            await self.store.release_space(obj)

    async def rename(self, op: int, old: bytes, np: int, new: bytes, flags: int) -> None:
        gone = self._describe_name(np, new)
        obj = self.ns.rename(op, old, np, new, flags, self.is_open)
        if obj is not None:
            self._removed(obj, gone)
            await self.store.release_space(obj)

    # ---- KV events (kvfs.events): what a removed name was -----------------------
    def _describe(self, obj: Obj) -> tuple[str, dict | None]:
        rec = self.index.get_inode(obj.ino)
        if rec is None or rec.get("oid") != obj.oid:
            return obj.key, None
        return self.ns.path_of(obj.ino), rec.get("kv")

    def _describe_name(self, parent: int, name: bytes) -> tuple[str, dict | None] | None:
        """Path and KV record of ``parent/name`` while it still exists (only with readers)."""
        if not self.telemetry.events.active:
            return None
        ino = self.index.lookup(parent, name)
        rec = self.index.get_inode(ino) if ino is not None else None
        if rec is None:
            return None
        return self.ns.path_of(ino), rec.get("kv")

    def _removed(self, obj: Obj, gone: tuple[str, dict | None] | None) -> None:
        path, kv = gone if gone is not None else (obj.key, None)
        self.telemetry.events.emit("removed", obj, None, path=path, kv=kv or {})

    # ---- xattrs -----------------------------------------------------------------
    def _sealed(self, ino: int) -> Obj | None:
        rec = self.ns.inode(ino)
        return self.store.objs.get(rec.get("oid"))

    def get_xattr(self, ino: int, name: bytes) -> bytes:
        rec = self.ns.inode(ino)
        if name.startswith(KV_PREFIX):
            value = self._kv_xattr(ino, rec, name[len(KV_PREFIX):].decode("ascii", "replace"))
            if value is None:
                raise NamespaceError(errno.ENODATA)
            return value.encode()
        try:
            return rec["xattrs"][name]
        except KeyError:
            raise NamespaceError(errno.ENODATA) from None

    def _kv_xattr(self, ino: int, rec: dict, key: str) -> str | None:
        if not stat.S_ISREG(rec["mode"]):
            return None
        obj = self.store.objs.get(rec.get("oid"))
        kv = rec.get("kv") or {}
        if key == "pin":
            return "1" if rec.get("pin") else "0"
        if key == "tier":
            if ino in self.writers and self.writers[ino].dirty:
                return self.store.ram.name
            return self.store.top_tier(obj) if obj else None
        if obj is None:
            return None
        if key == "checksum":
            return checksum.hexdigest(obj.checksum)
        if key == "hits":
            return str(obj.hits)
        if key == "atime":
            return f"{obj.atime:.3f}"
        if key in ("tokens", "parent", "hash", "namespace"):
            return kv.get(key) if kv else None
        if key == "backing":
            return self._backing(obj)
        return None

    def _backing(self, obj: Obj) -> str | None:
        b = self.backing_of(obj)
        return None if b is None else json.dumps(b)

    def _fast_copy(self, obj: Obj) -> tuple[Tier, bytes] | None:
        """The copy the fast path reads: ``obj``'s highest copy on an available tier."""
        for t in self.store.tiers:
            if t.name in obj.place and t.available:
                return t, obj.place[t.name]
        return None

    def backing_of(self, obj: Obj) -> dict | None:
        """Where the fast path reads ``obj``: its highest available copy, if that tier has
        a location a loader can read (tmpfs or NVMe file); None otherwise."""
        copy = self._fast_copy(obj)
        b = copy and copy[0].backing(obj.oid, copy[1])
        if not b:
            return None
        return dict(b, tier=copy[0].name, size=obj.size, checksum=checksum.hexdigest(obj.checksum))

    def list_xattrs(self, ino: int) -> list[bytes]:
        rec = self.ns.inode(ino)
        names = list(rec["xattrs"])
        if stat.S_ISREG(rec["mode"]):
            names += [KV_PREFIX + k for k in (b"tier", b"checksum", b"pin", b"hits", b"atime")]
            if rec.get("kv"):
                names += [KV_PREFIX + b"tokens", KV_PREFIX + b"parent"]
        return names

    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        rec = self.ns.inode(ino)
        if not name.startswith(b"user."):
            raise NamespaceError(errno.ENOTSUP)
        if name.startswith(KV_PREFIX):
            if name != KV_PREFIX + b"pin":
                raise NamespaceError(errno.EPERM, f"{name.decode()} is read-only")
            if not stat.S_ISREG(rec["mode"]):
                raise NamespaceError(errno.EINVAL)
            v = value.strip()
            if v not in (b"0", b"1"):
                raise NamespaceError(errno.EINVAL, "user.kvfs.pin takes 1 or 0")
            self.ns.update(ino, pin=v == b"1")
            obj = self.store.objs.get(rec.get("oid"))
            if obj is not None:
                obj.pinned = v == b"1"
            return
        if len(value) > XATTR_MAX:
            raise NamespaceError(errno.E2BIG)
        self.ns.set_user_xattr(ino, name, value)

    def remove_xattr(self, ino: int, name: bytes) -> None:
        if name.startswith(KV_PREFIX):
            raise NamespaceError(errno.EPERM)
        self.ns.remove_user_xattr(ino, name)

    # ---- control and stats ------------------------------------------------------
    def prefix_objects(self, paths: list[bytes], base: bytes = b"", cred: Cred = ROOT) -> list[Obj]:
        """The sealed objects of the leading ``paths`` (relative to ``base``, itself relative
        to the root) that are sealed regular files; the first path that is not ends the prefix.
        One index read transaction; sealed-ness comes from memory, not from inode records.
        A caller other than root sees a file only if it could open it for reading through
        the mount (search permission on every directory on the way, read on the file)."""
        comps = [c for c in base.split(b"/") if c and c != b"."]
        rel = [p.strip(b"/") for p in paths]
        if cred.uid == 0:
            return self.index.resolve_prefix(comps, rel, self.ns.sealed)
        return self._prefix_objects_as(comps, rel, cred)

    def _prefix_objects_as(self, base: list[bytes], paths: list[bytes], cred: Cred) -> list[Obj]:
        searchable: dict[int, bool] = {}

        def enter(ino: int) -> bool:
            ok = searchable.get(ino)
            if ok is None:
                rec = self.index.get_inode(ino)
                ok = searchable[ino] = bool(rec) and stat.S_ISDIR(rec["mode"]) and cred.may(rec, 1)
            return ok

        def walk(ino: int, comps) -> int | None:
            for c in comps:
                if not c or c == b".":
                    continue
                if not enter(ino):
                    return None
                ino = self.index.lookup(ino, c)
                if ino is None:
                    return None
            return ino

        top = walk(ROOT_INO, base)
        out: list[Obj] = []
        if top is None:
            return out
        for p in paths:
            *dirs, name = p.split(b"/")
            parent = walk(top, dirs)
            if parent is None or not enter(parent):
                break
            ino = self.index.lookup(parent, name)
            obj = self.ns.sealed.get(ino) if ino is not None else None
            if obj is None or obj.dead:
                break
            rec = self.index.get_inode(ino)
            if rec is None or not cred.may(rec, 4):
                break
            out.append(obj)
        return out

    def prefix_answer(self, objs: list[Obj]) -> dict:
        """The lookup answer for the leading sealed objects of a chain: count and top tiers."""
        top = self.store.top_tier
        return {"prefix": len(objs), "tiers": [top(o) for o in objs]}

    # ---- leases: the fast path's batched backing locations -------------------------
    def grant_lease(self, paths: list[bytes], base: bytes = b"", ttl: float = LEASE_TTL,
                    cred: Cred = ROOT) -> tuple[int, bytes]:
        """Backing locations of the leading sealed ``paths``, held for the loader until
        ``release_lease`` (or ``ttl`` seconds): while leased, an object is neither demoted,
        evicted nor freed (it counts as open). Each block counts a hit, like an open.
        Returns the lease id and the answer (JSON, see kvfs/fs/control.py).

        A caller other than root gets only what it could read through the mount, a ttl of
        at most LEASE_TTL_MAX_USER, at most LEASES_PER_USER live leases (a new one releases
        its oldest) and pins at most 1/LEASE_PIN_SHARE of the RAM tier: blocks past that
        are answered ``null`` (read them through the mount) and not held."""
        if not (0 < ttl <= LEASE_TTL_MAX):
            raise NamespaceError(errno.EINVAL, f"lease ttl out of range (0, {LEASE_TTL_MAX:g}]")
        objs = self.prefix_objects(paths, base, cred)
        budget = None
        if cred.uid != 0:
            ttl = min(ttl, LEASE_TTL_MAX_USER)
            mine = sorted((lz for lz in self.leases.values() if lz.uid == cred.uid), key=lambda lz: lz.id)
            for old in mine[:max(0, len(mine) - LEASES_PER_USER + 1)]:
                self._drop_lease(old.id)
            budget = self.store.ram.capacity // LEASE_PIN_SHARE - sum(
                lz.pinned for lz in self.leases.values() if lz.uid == cred.uid)
        lease = Lease(self._next_lease, [], time.monotonic() + ttl, cred.uid)
        self._next_lease += 1
        entries = []
        for obj in objs:
            if budget is not None and obj.size > budget - lease.pinned:
                entries.append("null")           # over this user's share: read through the mount
                continue
            obj.refs += 1
            lease.objs.append(obj)
            lease.pinned += obj.size
            self.store.note_open(obj)
            entries.append(self.lease_entry(obj))
        self.leases[lease.id] = lease
        answer = self.prefix_answer(objs)
        answer.update(lease=lease.id, ttl=ttl)
        head = json.dumps(answer, separators=(",", ":"))
        return lease.id, (head[:-1] + ',"blocks":[' + ",".join(entries) + "]}\n").encode()

    def _drop_lease(self, lease_id: int) -> None:
        """Release a lease from sync code: its objects are freed by the next release_space."""
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            for obj in lease.objs:
                obj.refs -= 1
            self._released.extend(lease.objs)

    def lease_entry(self, obj: Obj) -> str:
        """``obj``'s lease entry as JSON text: ``[tier, path, offset, size, checksum, direct]``
        (its highest available copy) or ``null`` (no fast path). Memoised per object and
        placement: a hot prefix is leased again and again."""
        copy = self._fast_copy(obj)
        if copy is None:
            return "null"
        memo = self._lease_entries.get(obj.oid)
        if memo is not None and memo[:2] == (copy[0].name, copy[1]):
            return memo[2]
        text = encode_lease_entry(self.backing_of(obj))
        if len(self._lease_entries) >= _LEASE_ENTRY_MEMO:
            self._lease_entries.clear()
        self._lease_entries[obj.oid] = (copy[0].name, copy[1], text)
        return text

    async def release_lease(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            for obj in lease.objs:
                obj.refs -= 1
                await self.store.release_space(obj)
        while self._released:
            await self.store.release_space(self._released.pop())
        return lease is not None

    async def expire_leases(self) -> int:
        now = time.monotonic()
        old = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        for lid in old:
            log.debug("lease %d expired", lid)
            await self.release_lease(lid)
        if self._released:
            await self.release_lease(-1)
        return len(old)

    async def serve_leases(self, interval: float = 1.0) -> None:
        """Background task: release leases whose holder neither released nor closed them."""
        while True:
            await trio.sleep(interval)
            await self.expire_leases()

    def statfs(self) -> tuple[int, int]:
        tiers: list[Tier] = self.store.tiers
        total = sum(t.capacity for t in tiers)
        free = sum(t.free() for t in tiers if t.available)
        return total, free

    def statistics(self) -> dict:
        # counts() commits the pending index changes first: what the stats describe is in
        # LMDB (a reader that then sees no open handles may kill -9 and find every closed file)
        counts = self.index.counts()
        return {"tiers": self.store.statistics(), "inodes": counts["inodes"], "objects": len(self.store.objs),
                "open_handles": len(self.handles) + self._releasing, "writing": len(self.writers), "leases": len(self.leases),
                "settled": self.store.settled(), "time": time.time()}
