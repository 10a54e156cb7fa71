"""A data region this node took over from a dead node: now its own to free and allocate in.

After a takeover (docs/scale-out.md, "The taker owns a taken-over region") the region's
format-1 volume is opened as a ``HeldRegion``: an ordinary ``RemoteTier`` over a
``RegionVolume`` of the region, sharing the node's write guard. Its records are of two kinds:

* **inherited**: records the dead node wrote (and this node republished at takeover). They
  are not counted as used space: they are a cache the holder may drop whenever it needs the
  room. ``reclaim`` frees them one at a time (oldest table slot first), each through the
  holder's own log (a ``free`` entry), a zeroed record header and a freed table entry, so the
  other nodes drop the name and a reader holding the old record misses.
* **own**: records this node put into the region (loc version 3, which names the region).
  The store's index holds them; after a restart the index tells them apart
  (``mark_own``), and a record the index does not hold stays inherited (reclaimable).

The holder writes in the region only after ``writable_at`` (lease + grace + I/O timeout
after its claim), so a write the dead node issued before it froze has landed or been dropped.
"""
from __future__ import annotations

import logging
import struct

from kvfs.errors import NoSuchObject
from kvfs.remote.share.region import RegionVolume
from kvfs.remote.tier import _LOC, RemoteTier

log = logging.getLogger(__name__)

HELD_LOC = struct.Struct("<BHIQIH")     # 3, region, table slot, start unit, units, header units


def is_held_loc(loc) -> bool:
    loc = bytes(loc)
    return len(loc) == HELD_LOC.size and loc[0] == 3


def held_loc(region: int, loc: bytes) -> bytes:
    _v, slot, start, units, hu = _LOC.unpack(bytes(loc))
    return HELD_LOC.pack(3, region, slot, start, units, hu)


def unpack_held_loc(loc) -> tuple[int, bytes]:
    """(region, the region tier's own loc) of a held-region loc."""
    _v, region, slot, start, units, hu = HELD_LOC.unpack(bytes(loc))
    return region, _LOC.pack(1, slot, start, units, hu)


class HeldRegion(RemoteTier):
    """The format-1 object store inside a taken-over region."""

    def __init__(self, region_vol: RegionVolume, *, region: int, owner: str, writable_at: float):
        super().__init__(region_vol, instance_id=owner, format=False)
        self.region = region
        self.writable_at = writable_at
        self.own: set[int] = set()            # table slots of records this node put here
        self.reclaimed = 0

    async def open(self) -> None:
        """Read the region's superblock and table (reads only: a blank or damaged region is
        refused, never formatted)."""
        try:
            sb = await self._read_superblock()
        except ValueError as e:
            self._refuse(f"taken-over region {self.region}: {e}")
        if sb is None:
            self._refuse(f"taken-over region {self.region} holds no volume")
        self.instance_id = sb.owner
        await self._load(first=True)

    @property
    def own_used(self) -> int:
        return sum(e[3] for s, e in self.entries.items() if s in self.own) * self.unit

    def inherited(self) -> list[tuple[int, tuple]]:
        """(table slot, entry) of the records this node did not put, oldest slot first."""
        return sorted((s, e) for s, e in self.entries.items() if s not in self.own)

    def mark_own(self, loc: bytes) -> None:
        slot = _LOC.unpack(bytes(loc))[1]
        if slot in self.entries:
            self.own.add(slot)

    async def put(self, info, data) -> bytes:
        loc = await super().put(info, data)
        self.own.add(_LOC.unpack(loc)[1])
        return loc

    async def delete(self, oid: int, loc: bytes) -> None:
        try:
            slot, _e = self._entry(oid, loc)
        except NoSuchObject:
            return
        self.own.discard(slot)
        await super().delete(oid, loc)

    def fits(self, size: int) -> bool:
        """Would a record of ``size`` bytes find room now (without freeing anything)?"""
        units = self.footprint(size) // self.unit
        start = self._alloc.alloc(units)
        if start is None:
            return False
        self._alloc.free(start, units)
        return self._slots is not None and len(self.entries) < self.sb.slots

    def loc_of(self, slot: int) -> bytes:
        oid, start, _size, units, hu = self.entries[slot]
        return _LOC.pack(1, slot, start, units, hu)

    def header_loc(self, slot: int) -> tuple[int, int]:
        """(oid, start unit) of a record."""
        oid, start, _size, _units, _hu = self.entries[slot]
        return oid, start


def describe(t: HeldRegion) -> dict:
    inh = t.inherited()
    return {"capacity": t.capacity, "own_bytes": t.own_used, "own_objects": len(t.own),
            "inherited_bytes": sum(e[3] for _s, e in inh) * t.unit, "inherited_objects": len(inh),
            "reclaimed": t.reclaimed}
