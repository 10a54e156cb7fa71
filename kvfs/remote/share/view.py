"""The read-only view of other nodes' published blocks, fed by tailing their logs.

``SharedView`` maps a path to the newest published record of it (owner slot + log entry).
``Tailer.poll`` reads the node slots, then each other node's log from where it left off:
entries are applied in sequence order and the first entry that is missing, torn or out of
sequence ends that node's batch (it is read again at the next poll). A node more than a ring
ahead of us (a sequence gap) is re-read whole; when its ring no longer holds its first entry
(it wrapped), the record tables of the regions it holds are read too, so blocks published
more than a ring ago are not lost (``region_records``). Nothing here is written to the local
index.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from kvfs.remote import volume_format as L
from kvfs.remote.share import format as F
from kvfs.remote.share.member import read_claims, read_slots, read_units
from kvfs.remote.volume import Volume

log = logging.getLogger(__name__)

_READ_UNITS = 16          # log units read per node per poll at most


@dataclasses.dataclass(frozen=True)
class Published:
    slot: int             # the owner's node slot
    node_id: str
    entry: F.LogEntry


class SharedView:
    def __init__(self) -> None:
        self.by_path: dict[str, Published] = {}
        self._by_oid: dict[tuple[int, int, int, int], str] = {}   # (slot, region, oid, start) -> path
        self.dirs: dict[str, dict[str, int]] = {}     # directory -> child name -> published paths under it
        # (path, Published) of names that went away or were replaced, for the node to drop
        self.dropped: list[tuple[str, Published]] = []

    def __len__(self) -> int:
        return len(self.by_path)

    def get(self, path: str) -> Published | None:
        return self.by_path.get(path)

    def children(self, dirpath: str) -> set[str]:
        return set(self.dirs.get(dirpath.rstrip("/") or "/", ()))

    def apply(self, slot: int, node_id: str, e: F.LogEntry) -> None:
        if e.op == F.OP_PUT:
            prev = self._by_oid.get((slot, e.region, e.oid, e.start))
            if prev is not None and prev != e.key:      # republished under a new name (rename)
                self._remove(prev, self.by_path[prev])
            old = self.by_path.get(e.key)
            p = Published(slot, node_id, e)
            if old is not None and _same_block(old.entry, e):   # republished by a new owner (takeover)
                self._by_oid.pop((old.slot, old.entry.region, old.entry.oid, old.entry.start), None)
                self.by_path[e.key] = p
                self._by_oid[(slot, e.region, e.oid, e.start)] = e.key
                return
            if old is not None:
                self._remove(e.key, old)
            self.by_path[e.key] = p
            self._by_oid[(slot, e.region, e.oid, e.start)] = e.key
            self._link(e.key)
        elif e.op == F.OP_FREE:
            path = self._by_oid.get((slot, e.region, e.oid, e.start))     # that record, not another
            if path is not None:
                self._remove(path, self.by_path[path])

    def drop_owner(self, slot: int) -> None:
        for path, p in list(self.by_path.items()):
            if p.slot == slot:
                self._remove(path, p)

    def _remove(self, path: str, p: Published) -> None:
        del self.by_path[path]
        if self._by_oid.get((p.slot, p.entry.region, p.entry.oid, p.entry.start)) == path:
            del self._by_oid[(p.slot, p.entry.region, p.entry.oid, p.entry.start)]
        self._unlink(path)
        self.dropped.append((path, p))

    def _levels(self, path: str):
        parts = path.strip("/").split("/")
        for i in range(len(parts)):
            yield "/" + "/".join(parts[:i]), parts[i]

    def _link(self, path: str) -> None:
        for parent, name in self._levels(path):
            counts = self.dirs.setdefault(parent, {})
            counts[name] = counts.get(name, 0) + 1

    def _unlink(self, path: str) -> None:
        for parent, name in self._levels(path):
            counts = self.dirs.get(parent, {})
            n = counts.get(name, 0) - 1
            if n > 0:
                counts[name] = n
                continue
            counts.pop(name, None)
            if not counts:
                self.dirs.pop(parent, None)


def _same_block(a: F.LogEntry, b: F.LogEntry) -> bool:
    return (a.region, a.start, a.oid, a.generation, a.region_uuid) == (b.region, b.start, b.oid, b.generation,
                                                                        b.region_uuid)


class Tailer:
    def __init__(self, vol: Volume, sb: F.Superblock2, my_slot: int, view: SharedView):
        self.vol, self.sb, self.my_slot, self.view = vol, sb, my_slot, view
        self.next_seq: dict[int, int] = {}        # slot -> next sequence number expected
        self.nodes: dict[int, F.NodeSlot] = {}
        self.slots: list = []                    # every slot as read by the last poll
        self.polls = 0
        self.entries = 0
        self.rescans = 0
        self.wraps = 0                           # rescans that found a ring wrapped
        self.region_scans = 0                    # region tables read to make up for one

    async def poll(self) -> int:
        """One pass over every other node's log; returns how many entries were applied."""
        slots = self.slots = await read_slots(self.vol, self.sb)
        n = 0
        for i, s in enumerate(slots):
            if i == self.my_slot or s is None or s.free:
                continue
            self.nodes[i] = s
            if i not in self.next_seq:
                n += await self.rescan(i, s)
            else:
                n += await self._tail(i, s)
        self.polls += 1
        self.entries += n
        return n

    async def rescan(self, slot: int, s: F.NodeSlot) -> int:
        """Read the whole ring and apply the run of consecutive entries that ends at the
        newest. When that run does not start at the node's first entry (the ring wrapped:
        older entries were overwritten), first take the records of every region the node
        holds from their tables (read before the ring, so the ring's newer entries win).
        On a rescan of a node already in the view, only names that changed are dropped."""
        sb = self.sb
        base = None
        if s.log_seq > sb.log_entries or slot in self.next_seq:
            base = await self.region_records(slot)          # may be needed: read before the ring
        raw = await read_units(self.vol, sb.log_off(slot), sb.log_units, sb.unit)
        found: dict[int, F.LogEntry] = {}
        for k in range(sb.log_entries):
            e = F.unpack_entry(raw, k * F.ENTRY)
            if e is not None and (e.seq - 1) % sb.log_entries == k:
                found[e.seq] = e
        top = max(found, default=0)
        first = top
        while first - 1 in found:
            first -= 1
        run = [found[q] for q in range(first, top + 1)] if found else []
        if first > 1:                                       # wrapped: the ring alone is not enough
            if base is None:
                base = await self.region_records(slot)
            self.wraps += 1
            run = base + run
        fresh = SharedView()
        for e in run:
            fresh.apply(slot, s.node_id, e)
        if slot in self.next_seq:
            self.rescans += 1
            for path, p in list(self.view.by_path.items()):
                q = fresh.by_path.get(path)
                if p.slot == slot and (q is None or not _same_block(p.entry, q.entry)):
                    self.view._remove(path, p)
        for path, p in sorted(fresh.by_path.items(), key=lambda kv: kv[1].entry.seq):
            self.view.apply(slot, s.node_id, p.entry)
        self.next_seq[slot] = top + 1 if found else 1
        return len(run)

    async def region_records(self, slot: int) -> list[F.LogEntry]:
        """A put entry (seq 0) for every live record in the regions whose claim by ``slot``
        stands, from each region's allocation table and record headers. The name is the one
        in the record header: the name the block had when it was written."""
        sb2 = self.sb
        owners = F.owners(await read_claims(self.vol, sb2), sb2.regions) or {}
        out = []
        now = time.time_ns()
        for region in sorted(r for r, ss in owners.items() if slot in ss):
            off = sb2.region_off(region)
            try:
                rsb = L.Superblock.unpack(await self.vol.read(off, sb2.unit))
            except ValueError:
                continue
            if rsb is None:
                continue
            table = await self.vol.read(off + rsb.table_start * rsb.unit, rsb.table_units * rsb.unit)
            for k in range(rsb.slots):
                ent = L.unpack_entry(table, k * L.ENTRY_SIZE)
                if ent is None:
                    continue
                oid, start, _size, units, hu = ent
                try:
                    info = L.unpack_header(await self.vol.read(off + start * rsb.unit, hu * rsb.unit),
                                           rsb.volume_uuid)
                except ValueError:
                    continue                # torn, or freed (zeroed header) since the table was read
                if info.oid != oid or len(info.key.encode("utf-8", "surrogateescape")) > F.MAX_KEY:
                    continue
                out.append(F.LogEntry(0, 0, F.OP_PUT, region, start, units, hu, oid, info.generation, info.size,
                                      info.checksum, info.chunk_size, rsb.volume_uuid, now, info.key))
        self.region_scans += 1
        return out

    async def _tail(self, slot: int, s: F.NodeSlot) -> int:
        sb = self.sb
        per = sb.unit // F.ENTRY
        seq = self.next_seq[slot]
        pos = (seq - 1) % sb.log_entries
        first_unit = pos // per
        units = min(_READ_UNITS, sb.log_units - first_unit)
        raw = await read_units(self.vol, sb.log_off(slot) + first_unit * sb.unit, units, sb.unit)
        n = 0
        k = pos - first_unit * per
        while k < units * per:
            e = F.unpack_entry(raw, k * F.ENTRY)
            if e is None or e.seq < seq:
                break
            if e.seq > seq:                 # lapped: we missed a ring's worth
                log.warning("log of node %r is more than a ring ahead; re-reading it", s.node_id)
                return await self.rescan(slot, s)
            self.view.apply(slot, s.node_id, e)
            seq += 1
            n += 1
            k += 1
        self.next_seq[slot] = seq
        return n

    def status(self) -> dict:
        return {"polls": self.polls, "entries": self.entries, "rescans": self.rescans, "wraps": self.wraps,
                "region_scans": self.region_scans,
                "peers": {s.node_id: {"slot": i, "epoch": s.epoch, "next_seq": self.next_seq.get(i, 0)}
                          for i, s in self.nodes.items()}}
