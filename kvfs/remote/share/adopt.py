"""Names from the shared view in this node's namespace.

A lookup that misses the local table asks ``SharedNames.lookup``: a path another node
published becomes a local file whose only copy is the owner's record ("foreign" location on
the remote tier), after its record header was read and still names the published block;
a path under which blocks were published becomes a local directory. Reading it goes
through the store like any remote object (every chunk's xxh3 checked against the header's
sums). When the owner frees or replaces the block (its log says so), the local name is
dropped the way an evicted one is, and the kernel is told.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

import trio

from kvfs.errors import NamespaceError, TierUnavailable
from kvfs.remote.share import format as F
from kvfs.remote.share.member import read_slots
from kvfs.remote.share.view import SharedView, Tailer
from kvfs.store.objects import Obj

log = logging.getLogger(__name__)


class SharedNames:
    """Made and hooked in by kvfs.build.attach_shared: ``tier.on_dropped`` is
    ``dropped_by_owner``, the store's ``on_renamed`` is ``renamed``. ``ns``, ``index`` and
    ``store``: the mount's namespace, index and object store; ``kernel_synced``: async (),
    returns once the kernel's caches dropped what was removed."""

    def __init__(self, ns, index, store, tier, kernel_synced=None):
        self.ns = ns
        self.index = index
        self.store = store
        self.tier = tier
        self.adopted = 0
        self.dropped = 0
        self.kernel_synced = kernel_synced

    def _path(self, parent: int, name: bytes) -> str:
        return self.ns.path_of(parent).rstrip("/") + "/" + name.decode("utf-8", "surrogateescape")

    async def lookup(self, parent: int, name: bytes) -> int | None:
        """The inode of ``name`` made from the shared view, or None when the view lacks it."""
        path = self._path(parent, name)
        view = self.tier.view
        p = view.get(path)
        uid, gid = os.getuid(), os.getgid()
        if p is None:
            if not view.children(path):
                return None
            return self._make(parent, name, stat.S_IFDIR | 0o755, uid, gid)
        try:
            info = await self.tier.foreign_header(p)
        except TierUnavailable:
            return None
        if info is None:
            return None
        # the name may have appeared while the header was read (a local write, another lookup)
        ino = self._make(parent, name, stat.S_IFREG | 0o644, uid, gid)
        rec = self.index.get_inode(ino)
        if rec is None or rec.oid is not None:
            return ino
        store = self.store
        obj = Obj(self.index.new_id(b"oid"), info.size, info.checksum, info.chunk_size, info.chunk_sums,
                  {self.tier.name: F.pack_foreign_loc(p.slot, p.entry)}, ino, path, info.generation,
                  atime=time.time())
        store.adopt(obj)
        _old, installed = self.ns.install(ino, obj, None, mtime=p.entry.mtime_ns)
        if not installed:
            await store.release_space(obj)
            return None
        self.adopted += 1
        log.debug("adopted %s from node %r (object %x)", path, p.node_id, p.entry.oid)
        return ino

    def _make(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> int:
        try:
            ino, _rec = self.ns.make(parent, name, mode, uid, gid)
            return ino
        except NamespaceError as e:
            if e.errno != errno.EEXIST:
                raise
            return self.ns.lookup(parent, name)

    async def adopt_paths(self, groups) -> None:
        """For a ``.kvfs/lookup`` request: make the published paths of its prefix local, up
        to the first path that is neither local nor published (where the prefix ends)."""
        index = self.index
        for base, paths in groups:
            for p in paths:
                ino = 1
                for c in [c for c in (base + b"/" + p).split(b"/") if c and c != b"."]:
                    nxt = index.lookup(ino, c)
                    if nxt is None:
                        nxt = await self.lookup(ino, c)
                    if nxt is None:
                        return
                    ino = nxt

    async def fill(self, dir_ino: int) -> None:
        """Make every name the view has directly in this directory (before a readdir)."""
        names = self.tier.view.children(self.ns.path_of(dir_ino))
        index = self.index
        for name in sorted(names):
            b = name.encode("utf-8", "surrogateescape")
            if index.lookup(dir_ino, b) is None:
                await self.lookup(dir_ino, b)

    async def reconcile(self) -> int:
        """At mount: drop adopted names whose block the view no longer publishes (freed or
        replaced while this node was down), and count only this node's records as the remote
        tier's use (the store's load counts every object placed there)."""
        tier, store = self.tier, self.store
        tier.recount(bytes(o.place[tier.name]) for o in store.objs.values() if tier.name in o.place)
        stale = []
        for obj in list(store.objs.values()):
            f = F.unpack_foreign_loc(obj.place.get(tier.name, b""))
            if f is None:
                continue
            p = tier.view.get(obj.key)
            if p is None or not _same_record(f, p.entry):
                stale.append(obj)
        for obj in stale:
            await store.lose(obj)
        self.dropped += len(stale)
        if stale:
            log.info("dropped %d adopted names their owners freed while this node was down", len(stale))
        return len(stale)

    async def republish_renamed(self) -> int:
        """At mount: publish again, under the name the index holds, every record of ours that
        our own log last published under another name. A rename is published when it
        happens, but its index change may be in the group commit a kill -9 lost: the other
        nodes would go on seeing the new name while this node has the old one."""
        tier = self.tier
        if tier.slot < 0 or tier.fenced:
            return 0
        own = SharedView()
        slots = await read_slots(tier.parent, tier.sb2)
        me = slots[tier.slot]
        if me is None:
            return 0
        await Tailer(tier.parent, tier.sb2, -1, own).rescan(tier.slot, me)
        published = {(e.region, e.oid): path for path, p in own.by_path.items() for e in (p.entry,)}
        n = 0
        for obj in list(self.store.objs.values()):
            loc = obj.place.get(tier.name)
            if loc is None or F.unpack_foreign_loc(loc) is not None:
                continue
            path = published.get((tier.region, obj.oid))
            self.store.rekey(obj)
            if path is not None and path != obj.key:
                await tier.republish(obj.info(), loc)
                n += 1
        if n:
            log.info("republished %d blocks under the names the index holds (renames lost by a crash)", n)
        return n

    async def renamed(self, parent: int, name: bytes) -> None:
        """A file of ours on the shared volume got a new name (a runtime's temp-then-rename
        after the block was already written down): publish it under the new name."""
        ino = self.index.lookup(parent, name)
        obj = self.ns.sealed.get(ino) if ino is not None else None
        loc = obj.place.get(self.tier.name) if obj is not None else None
        if loc is None or F.unpack_foreign_loc(loc) is not None:
            return
        self.store.rekey(obj)
        await self.tier.republish(obj.info(), loc)

    def _local(self, path: str) -> Obj | None:
        ino = 1
        index = self.index
        for part in path.strip("/").split("/"):
            ino = index.lookup(ino, part.encode("utf-8", "surrogateescape"))
            if ino is None:
                return None
        return self.ns.sealed.get(ino)

    async def dropped_by_owner(self, gone: list) -> None:
        """The owners freed or replaced these published blocks: drop the names made of them."""
        for path, p in gone:
            obj = self._local(path)
            if obj is None:
                continue
            f = F.unpack_foreign_loc(obj.place.get(self.tier.name, b""))
            if f is None or not _same_record(f, p.entry):
                continue                    # a local file of that name, or another version
            self.dropped += 1
            await self.store.lose(obj)
            await trio.lowlevel.checkpoint()
        if self.kernel_synced is not None:  # no process here opens a dropped name from then on
            await self.kernel_synced()

    def status(self) -> dict:
        return {"adopted": self.adopted, "dropped": self.dropped}


def _same_record(f: tuple, e: F.LogEntry) -> bool:
    """Does a foreign location name the record a log entry names? By place and identity
    (region, start, oid, generation), not by publisher: after a takeover the same record
    is published by the node that took its region over."""
    _slot, region, start, _units, _hu, oid, gen, _vid, _cks = f
    return (region, start, oid) == (e.region, e.start, e.oid) and (e.op == F.OP_FREE or gen == e.generation)
