"""The store's one entry point for the filesystem (``Store``).

``Store`` is composed of members, each a plain class owning its own state and given the
collaborators it needs: ``files`` (FileHandles, files.py: handles, write state, sealing),
``names`` (NameOps, nameops.py: lookups, directories, unlink and rename), ``xattrs`` (Xattrs,
xattrs.py), ``owners`` (Owners, owners.py: who is handed which backing file), ``leases``
(Leases, leases.py: prefix lookup and leases), ``commits`` (Commits, commit.py: batched
publication of caller-held bytes), ``gets`` (BatchGets, getbatch.py: many small files' bytes in
one answer). The fs layer calls the members (``store.files.open``, ``store.leases.grant``).
Here: building them, startup and recovery, the clean-unmount marker, orphans and stats.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from kvfs.store.commit import Commits
from kvfs.store.cred import ROOT, Cred  # noqa: F401  (re-exported: fs imports them from here)
from kvfs.store.files import FileHandles, Handle
from kvfs.store.getbatch import BatchGets
from kvfs.store.index import Index
from kvfs.store import marker, records
from kvfs.store.tally import recover as tally_recover
from kvfs.store.leases import Leases
from kvfs.store.nameops import NameOps
from kvfs.store.namespace import Namespace
from kvfs.store.objects import ObjectStore
from kvfs.store.owners import Owners
from kvfs.store.tier import Tier
from kvfs.store.xattrs import Xattrs

log = logging.getLogger(__name__)


class Store:
    """The filesystem's store: its members (see the module doc), built here over the index, the
    object store and the namespace, each given only the collaborators it calls."""

    def __init__(self, index: Index, store: ObjectStore, spill_dir):
        self.index = index
        self.store = store
        self.ns = Namespace(index, store)
        self.spill_dir = spill_dir
        store.ram.overflow = spill_dir      # where a write goes when RAM's tmpfs is full (kvfs.store.ramroom)
        self.telemetry = store.telemetry
        self.owners = Owners(index, store, self.ns)
        self.files = FileHandles(index, store, self.ns, spill_dir, self.owners.grants_follow_setattr)
        self.ns.is_open = self.files.is_open
        self.names = NameOps(index, store, self.ns, self.files.is_open, self.owners.grants_follow_rename)
        self.xattrs = Xattrs(store, self.ns, self.owners, self.files.dirty)
        self.leases = Leases(index, store, self.ns, self.owners)
        # (parent, name, inode) of the files a crash start dropped (kvfs.store.tally.recover):
        # a daemon that replaced a dead one tells the kernel, which may still cache them
        self.dropped_names: list[tuple[int, bytes, int]] = []
        self.commits = Commits(index, store, self.ns, self.files, self.names, spill_dir)
        self.gets = BatchGets(store, self.leases.prefix_objects)
        self.telemetry.events.describe = self.names.describe

    @property
    def handles(self) -> dict[int, Handle]:
        """The open file handles (FileHandles'), by handle number: kvfs.quota reads them."""
        return self.files.handles

    @property
    def on_renamed(self) -> Callable[[int, bytes], Awaitable[None]] | None:
        """``(new parent, new name)`` after a rename, a seal that raced one, or a commit's
        publication: a shared volume republishes the block (kvfs.remote.share)."""
        return self.names.on_renamed

    @on_renamed.setter
    def on_renamed(self, hook: Callable[[int, bytes], Awaitable[None]] | None) -> None:
        self.names.on_renamed = self.files.on_renamed = self.commits.on_renamed = hook

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
            counts = tally_recover(self.index, tally.footprints, self.dropped_names)
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
        files = self.files
        if files.writers or files.handles:
            log.info("not marking the unmount clean: %d files still open", len(files.handles))
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
                "open_handles": self.files.open_handles(), "writing": len(self.files.writers),
                "leases": len(self.leases.live),
                "settled": self.store.settled(), "table_loaded": self.store.table_loaded,
                "objects_built": dict.__len__(self.store.objs), "time": time.time()}
