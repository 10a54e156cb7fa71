"""The store's one entry point for the filesystem (``Cache``).

``Cache`` is a facade over the store's concerns, each in its own module:
files.py (handles, write state, sealing), xattrs.py, leases.py (prefix lookup and leases),
sniff.py (is a sealed buffer a KV block), cred.py (who asks), owners.py (who is handed which
backing file), commit.py (batched publication of caller-held bytes), getbatch.py (many small files' bytes
in one answer). Here: its state, startup and
recovery, the namespace pass-throughs that free bytes, KV-event descriptions and stats.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from kvfs.store.commit import Commits
from kvfs.store.cred import ROOT, Cred  # noqa: F401  (re-exported: fs imports them from here)
from kvfs.store.files import CREATE_MTIME_SLACK, FileHandles, Handle, WriteState  # noqa: F401
from kvfs.store.getbatch import BatchGets
from kvfs.store.index import Index
from kvfs.store import marker, records
from kvfs.store.tally import recover as tally_recover
from kvfs.store.leases import Lease, Leases
from kvfs.store.namespace import Namespace
from kvfs.store.objects import Obj, ObjectStore
from kvfs.store.owners import Owners
from kvfs.store.tier import Tier
from kvfs.store.xattrs import KV_PREFIX, XATTR_MAX, Xattrs  # noqa: F401

log = logging.getLogger(__name__)


class Cache(FileHandles, Xattrs, Leases, Owners, Commits, BatchGets):
    def __init__(self, index: Index, store: ObjectStore, spill_dir):
        self.index = index
        self.store = store
        self.ns = Namespace(index, store)
        self.ns.is_open = self.is_open
        self.spill_dir = spill_dir
        store.ram.overflow = spill_dir      # where a write goes when RAM's tmpfs is full (kvfs.store.ramroom)
        self.handles: dict[int, Handle] = {}
        self.writers: dict[int, WriteState] = {}
        self.open_count: dict[int, int] = {}
        self._next_fh = 1
        self.on_content_changed: Callable[[int], None] = lambda ino: None
        # (ino, write state serial, new object id) after a seal; default: content changed
        self.on_sealed: Callable[[int, int, int], None] = lambda ino, serial, oid: self.on_content_changed(ino)
        self.leases: dict[int, Lease] = {}
        self._next_lease = 1
        # (new parent, new name) after a rename: a shared volume republishes the moved block
        self.on_renamed: Callable[[int, bytes], Awaitable[None]] | None = None
        self._lease_entries: dict[int, tuple[str, bytes, str]] = {}    # see lease_entry
        self._released: list[Obj] = []       # objects of leases dropped in sync code
        self._releasing = 0                  # releases in progress (a seal may be running)
        self.telemetry = store.telemetry
        self.telemetry.events.describe = self._describe

    # ---- startup ------------------------------------------------------------
    async def start(self) -> dict[str, int]:
        """After a clean unmount (its marker in the index): nothing to recover, nothing
        decoded (kvfs.store.objtable). After a crash with valid running totals
        (kvfs.store.tally), no write behind kvfs's back since and totals that agree with
        LMDB's own count of object records (``Tally.inconsistency``): drop only what the
        unsealed and RAM-only sets name, then start as after a clean unmount from the
        totals. Otherwise (totals invalid: an index written without them, or changed by a
        tool, or totals that disagree) load the object table and recover the
        whole namespace (decoding and checking every record) and recount the totals."""
        clean = self.index.clean
        tally = self.store.tally
        wrong = tally.inconsistency() if clean is None and tally.valid and self.index.untouched else None
        if wrong is not None:
            log.warning("the running totals do not match the index (%s): recovering in full", wrong)
        elif clean is None and tally.valid and self.index.untouched:
            counts = tally_recover(self.index, tally.footprints)
            log.info("recovery from the unsealed and RAM-only sets: %s", counts)
            self.store.load_clean(tally.totals())
            self.ns.start_clean()
            return counts
        if clean is not None:
            self.store.load_clean(clean)
            self.ns.start_clean()
            log.info("clean start: %d objects, table scanned in the background", len(self.store.objs))
            return {"clean": 1}
        before = records.decoded
        lost = self.store.load()
        counts, unowned = self.ns.recover(lost)
        for obj in unowned:
            await self.store.release_space(obj)
        tally.reset((o.record() for o in self.store.objs.values()), kv=bool(self.ns.prefix.children))
        counts["decoded"] = records.decoded - before
        if any(counts.values()):
            log.info("full recovery: %s", counts)
        return counts

    def mark_clean(self) -> bool:
        """At a clean unmount, after the write-down: drop the files never sealed (what
        recovery would drop) and record the totals the next mount starts from. Not when
        a file is still being written or an object has no durable copy: the next mount
        then recovers as after a crash. Returns whether the marker was written."""
        if self.writers or self.handles:
            log.info("not marking the unmount clean: %d files still open", len(self.handles))
            return False
        volatile = {t.name for t in self.store.tiers if t.volatile}
        if any(o.size and set(o.place) <= volatile for o in self.store.objs.loaded()):
            log.info("not marking the unmount clean: RAM-only objects were not written down")
            return False
        dropped = self.ns.drop_unsealed()
        if dropped:
            log.info("dropped %d files that were never sealed", dropped)
        store = self.store
        if store.table_loaded:          # for the next start after a crash (kvfs.store.tally)
            store.tally.note_kv(bool(self.ns.prefix.children))
        marker.write(self.index, {
            "objects": len(store.objs),
            "tiers": {t.name: [t.used, t.objects] for t in store.tiers if not t.volatile},
            "namespaces": store.telemetry.totals(),
            # -1: not known (the scan of this session's clean start did not finish)
            "kv_parents": len(self.ns.prefix.children) if store.table_loaded else -1})
        return True

    async def sweep_orphans(self) -> int:
        """Delete backing objects on durable tiers that the index does not know (on a tier
        with ``sweep_by_location``, a shared volume, also records of a known object at a place
        the index does not hold: a put that committed before a crash recorded it, which other
        nodes would otherwise go on seeing)."""
        n = 0
        for tier in self.store.tiers[1:]:
            if not tier.available:
                continue
            by_loc = getattr(tier, "sweep_by_location", False)
            async for oid, loc, size in tier.scan():
                if not by_loc:          # known: its record exists (no Obj built for it)
                    if oid in self.store.objs:
                        continue
                    obj = None
                else:
                    obj = self.store.objs.get(oid)
                stray = (by_loc and obj is not None and not obj.busy
                         and bytes(obj.place.get(tier.name, b"")) != bytes(loc))
                if obj is None or stray:
                    self.index.commit()     # a record dropped in memory is gone from LMDB too
                    if tier.totals_from_records:
                        await tier.delete(oid, loc, counted=False)     # not in its totals
                    else:
                        await tier.delete(oid, loc)
                    n += 1
        if n:
            log.info("removed %d orphaned backing objects", n)
        return n

    # ---- names, for the fs layer (which goes through Cache only) ---------------------
    def find(self, parent: int, name: bytes) -> int | None:
        """The inode ``name`` names in directory ``parent``, or None."""
        return self.ns.find(parent, name)

    def inode(self, ino: int) -> dict:
        return self.ns.inode(ino)

    def top_of(self, ino: int) -> str:
        return self.ns.top_of(ino)

    def make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, **extra) -> tuple[int, dict]:
        """A directory or symlink (files come from ``create``)."""
        return self.ns.make(parent, name, mode, uid, gid, **extra)

    def rmdir(self, parent: int, name: bytes) -> None:
        self.ns.rmdir(parent, name)

    def entries(self, dir_ino: int, start_id: int):
        """``(entry id, name, inode, record)`` of directory ``dir_ino`` after ``start_id``."""
        for eid, name, ino in self.index.readdir(dir_ino, start_id):
            rec = self.index.get_inode(ino)
            if rec is not None:
                yield eid, name, ino, rec

    def evicted(self, ino: int) -> bool:
        """Inode ``ino`` was evicted with its name and is kept only for descriptors opened
        before (a reader of an older version): a new request by a name cannot mean it."""
        return ino in self.ns.evicted

    def dropped(self, ino: int) -> bool:
        """The daemon removed inode ``ino`` (eviction) though the kernel may still name it
        (an evicted inode kept for the descriptors of a reader of an older version too)."""
        return ino in self.ns.evicted or (self.index.get_inode(ino) is None and ino not in self.ns.orphans)

    def inode_count(self) -> int:
        return self.index.counts()["inodes"]

    def on_names_removed(self, callback) -> None:
        """``callback(parent, name)`` for each name the daemon removes by itself."""
        self.ns.on_name_removed = callback

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
        self.grants_follow_rename(op, np)
        if obj is not None:
            self._removed(obj, gone)
            await self.store.release_space(obj)
        if self.on_renamed is not None:
            await self.on_renamed(np, new)

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
                "settled": self.store.settled(), "table_loaded": self.store.table_loaded,
                "objects_built": dict.__len__(self.store.objs), "time": time.time()}
