"""The object table: oid -> ``Obj``, with the LMDB index as its compact form.

After a clean unmount the daemon does not decode the object records at mount: an
``Obj`` is built from its record the first time something asks for it (an open, a
lease, a victim search, a stat of its tiers) and kept from then on, so memory grows
with the objects used, not with the objects stored. What the store needs about the
others, it learns without keeping them:

* tier usage, object counts and per-namespace bytes come from the clean-unmount
  marker (kvfs.store.index ``Index.clean``), written by ``Store.mark_clean``;
* the per-tier LRU order (oids only) and the prefix-aware eviction counts
  (``PrefixRule.children``, kvfs.store.prefix) are built by ``ObjTable.scan``, a background task in the
  store's nursery that reads the records in batches on the trio thread. Eviction and
  demotion of a durable tier wait for it (``ObjectStore.wait_loaded``); lookups,
  reads, writes and stats do not.

After a crash (no marker) the same lazy start follows a recovery that reads only the
unsealed and RAM-only sets, with the totals kept in the index's group commits
(kvfs.store.tally). Only when those totals are not valid (an index written without them, or
changed behind kvfs's back) does the store decode everything at mount (``ObjectStore.load``),
and the table is then complete from the start.
"""
from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator

import trio

from kvfs.store import records
from kvfs.store.index import Index
from kvfs.store.records import InodeRecord, ObjectRecord
from kvfs.telemetry import namespace_of

if TYPE_CHECKING:
    from kvfs.store.objects import Obj

log = logging.getLogger(__name__)

SCAN_BATCH = 500            # records read per step of the background scan (5-15 ms on the trio thread here)
_U64 = struct.Struct(">Q")
_KV = b"bkv"                # the CBOR text key "kv" (an inode with a KV record)


class ObjTable(dict):
    """``dict`` of the materialized objects; ``get``/``[]``/``in`` also find an object that
    is only in the index (and materialize it), ``len`` counts every object."""

    def __init__(self, index: Index, build: Callable[[int, ObjectRecord], "Obj | None"]):
        super().__init__()
        self.index = index
        self._build = build         # record -> Obj (durable placement only), None if lost
        self.complete = True        # every object is materialized (after load())
        self.count = 0              # objects in the table, materialized or not

    # ---- lookups --------------------------------------------------------------
    def _fetch(self, oid) -> "Obj | None":
        if self.complete or oid is None:
            return None
        rec = self.index.get_object(oid)
        if rec is None:
            return None
        obj = self._build(oid, rec)
        if obj is not None:
            dict.__setitem__(self, oid, obj)
        return obj

    def get(self, oid, default=None):
        obj = dict.get(self, oid)
        if obj is None:
            obj = self._fetch(oid)
        return default if obj is None else obj

    def __missing__(self, oid):
        obj = self._fetch(oid)
        if obj is None:
            raise KeyError(oid)
        return obj

    def __contains__(self, oid) -> bool:
        return dict.__contains__(self, oid) or (
            not self.complete and oid is not None and self.index.get_object(oid) is not None)

    def __len__(self) -> int:
        return self.count

    # ---- whole-table iteration --------------------------------------------------
    def loaded(self) -> Iterator["Obj"]:
        """The materialized objects (all of them once ``complete``)."""
        return iter(list(dict.values(self)))

    def materialize_all(self) -> None:
        """Build every object (quota's namespace scan, tests): memory as before the lazy table."""
        if self.complete:
            return
        for oid, rec in self.index.iter_objects():
            if not dict.__contains__(self, oid):
                obj = self._build(oid, rec)
                if obj is not None:
                    dict.__setitem__(self, oid, obj)
        self.complete = True

    def values(self):
        self.materialize_all()
        return dict.values(self)

    def items(self):
        self.materialize_all()
        return dict.items(self)

    def __iter__(self):
        self.materialize_all()
        return dict.__iter__(self)

    def keys(self):
        self.materialize_all()
        return dict.keys(self)

    # ---- the background scan ---------------------------------------------------
    def begin_scan(self) -> None:
        """Take the snapshot the scan reads (before the first change of this session):
        the scan counts exactly the records as they were at mount, the session's own
        changes count themselves (a KV child removed before the scan met it is -1 until
        the scan's +1). A scan that is cancelled resumes where it stopped, on the same
        snapshot."""
        self.complete = False
        self.forgotten: set[int] = set()
        self._snap = self.index.env.begin()
        self._cold: dict[str, dict] | None = None
        self._phase, self._after = 0, None

    def forget(self, oid: int) -> bool:
        """``oid`` left the table (dropped; it was built: dropping takes an Obj). False
        when it was not in the table."""
        if dict.pop(self, oid, None) is None:
            return False
        self.count -= 1
        if self._snap is not None:
            self.forgotten.add(oid)
        return True

    _snap = None

    async def scan(self, durable: set[str], lru: dict, kv_add: Callable[[InodeRecord], None] | None) -> None:
        """Build the LRU order of the ``durable`` tiers (oid order, as ``load`` does) and
        the KV child counts (``kv_add`` of each KV inode; None: there are none) from the
        mount-time records, ``SCAN_BATCH`` at a time. Objects used meanwhile keep their
        place after the scanned ones (more recently used). Tiers that held no object at
        the unmount and an index without KV children are not read at all."""
        if self._snap is None:
            return
        if self._phase == 0:
            if self._cold is None:
                self._cold = {name: {} for name in durable}
            cold = self._cold
            async for oid, raw in self._records(self.index.objects if durable else None):
                if oid in self.forgotten:
                    continue
                obj = dict.get(self, oid)
                if obj is not None:
                    place, entry = obj.place, (namespace_of(obj.key), obj.size)
                else:
                    rec = records.decode_object(raw)
                    place, entry = rec.place, (namespace_of(rec.key), rec.size)
                for name in place:
                    if name in cold:
                        cold[name][oid] = entry
            for name, order in cold.items():
                lru[name].merge_older({o: e for o, e in order.items() if o not in self.forgotten})
            self._phase, self._after, self._cold = 1, None, None
        async for _ino, raw in self._records(self.index.inodes if kv_add else None):
            if _KV in raw:
                rec = records.decode_inode(raw)
                if rec.oid is not None:
                    kv_add(rec)
        snap, self._snap = self._snap, None
        snap.abort()
        self.forgotten = set()

    async def _records(self, db) -> AsyncIterator[tuple[int, bytes]]:
        """(key, raw record) of the records of ``db`` in the snapshot after ``_after``, a
        batch per step (none for ``db`` None); a step ends with every record of its batch
        handled by the caller, so a cancelled scan resumes after the last one."""
        if db is None:
            return
        cur = self._snap.cursor(db=db)
        found = cur.set_range(self._after + b"\0") if self._after is not None else cur.first()
        while found:
            batch = []
            while found and len(batch) < SCAN_BATCH:
                batch.append((cur.key(), cur.value()))
                found = cur.next()
            for key, raw in batch:
                yield _U64.unpack(key)[0], raw
            self._after = batch[-1][0]
            await trio.sleep(0)
