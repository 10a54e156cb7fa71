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

from kvfs.errors import ConfigError, NoSuchObject, TierFull, TierUnavailable
from kvfs.remote.share import format as F
from kvfs.remote.share.member import write_unit
from kvfs.remote.share.region import RegionVolume
from kvfs.remote.tier import _LOC, RemoteTier
from kvfs.store.tier import ObjectInfo

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
            slot, _e = self.entry(oid, loc)
        except NoSuchObject:
            return
        if slot in self.own:
            self.own.discard(slot)
        else:               # an inherited record freed (reclaimed, or dropped by the store)
            self.reclaimed += 1
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


class HoldsRegions:
    """SharedRemoteTier's part for the regions it took over (``held_tiers``): open them,
    put into them when its own region is full, reclaim the dead node's records there, free
    its own records there, count and list them."""

    @property
    def capacity(self) -> int:
        """Our region's data area plus that of every held region we may write in now (before
        ``writable_at`` a held region adds nothing: the store must not count on its room)."""
        now = self.clock()
        return self._own_capacity + sum(h.capacity for h in getattr(self, "held_tiers", {}).values()
                                        if now >= h.writable_at)

    @capacity.setter
    def capacity(self, v: int) -> None:
        self._own_capacity = v

    async def _open_held(self, region: int) -> None:
        """Open a held region's format-1 volume (reads only) so this node may reclaim the dead
        node's records there and put its own, from ``writable_at`` on."""
        if region in self.held_tiers or self.sb2 is None:
            return
        rv = RegionVolume(self.parent, self.sb2.region_off(region), self.sb2.region_bytes)
        rv.guard = self._may_write
        h = HeldRegion(rv, region=region, owner=self.instance_id,
                         writable_at=self.held[region]["writable_at"])
        try:
            await h.open()
        except (ConfigError, ValueError, TierUnavailable) as e:
            log.error("held region %d stays read-only: %s", region, e)
            return
        self.held_tiers[region] = h
        log.info("held region %d: %d inherited records (%d bytes), writable in %.1f s", region,
                 len(h.inherited()), sum(e[3] for _s, e in h.inherited()) * h.unit,
                 max(0.0, h.writable_at - self.clock()))

    async def _put_held(self, info: ObjectInfo, data: memoryview) -> bytes:
        """Our region is full: put into a held region, first freeing as many of the dead node's
        records there as the new one needs (each free published in our log)."""
        async with self._held_lock:     # one reclaim at a time: a header is zeroed only before its space is free
            return await self._put_held_locked(info, data)

    async def _put_held_locked(self, info: ObjectInfo, data: memoryview) -> bytes:
        for region, h in sorted(self.held_tiers.items()):
            if self.clock() < h.writable_at or not h.available or h.footprint(info.size) > h.capacity:
                continue
            while not h.fits(info.size) and h.inherited():
                await self._reclaim(h, *h.inherited()[0])
            if not h.fits(info.size):
                continue
            rloc = await h.put(info, data)
            units = _LOC.unpack(rloc)[3]
            self.used += units * h.unit
            self.objects += 1
            await self._publish(F.OP_PUT, info.oid, rloc, info, region, h.sb.volume_uuid)
            return held_loc(region, rloc)
        raise TierFull("remote tier: no room in our region or the regions we hold")

    async def _reclaim(self, h: HeldRegion, slot: int, entry: tuple) -> None:
        """Free one inherited record of a held region as its owner: publish the free, zero its
        header (a reader by location misses from now on), free its table entry."""
        oid, start, _size, _units, _hu = entry
        rloc = h.loc_of(slot)
        await self._publish(F.OP_FREE, oid, rloc, None, h.region, h.sb.volume_uuid)
        await write_unit(h.vol, start * h.unit, bytes(h.unit), h.unit)
        await h.delete(oid, rloc)          # counts it in h.reclaimed
        victim = self.held[h.region]["from_slot"]
        self.view.apply(victim, "", F.LogEntry(0, 0, F.OP_FREE, h.region, start, oid=oid))

    async def _delete_held(self, oid: int, loc: bytes) -> None:
        region, rloc = unpack_held_loc(loc)
        h = self.held_tiers.get(region)
        if h is None or self.fenced:
            return
        try:
            _slot, (_oid, start, _size, units, _hu) = h.entry(oid, rloc)
        except NoSuchObject:
            return
        if self.available:
            await self._check_fence()
        await self._publish(F.OP_FREE, oid, rloc, None, region, h.sb.volume_uuid)
        try:
            await write_unit(h.vol, start * h.unit, bytes(h.unit), h.unit)
        except TierUnavailable as e:
            log.warning("could not clear the record header of object %x: %s", oid, e)
        await h.delete(oid, rloc)
        self.used -= units * h.unit
        self.objects -= 1

    def recount(self, locs) -> None:
        """After the store loaded (``locs``: every loc the index holds on this tier): mark our
        own records in held regions, and count only our records as used (not the dead nodes'
        inherited ones, nor other nodes' blocks the index adopted)."""
        for loc in locs:
            if is_held_loc(loc):
                region, rloc = unpack_held_loc(loc)
                if region in self.held_tiers:
                    self.held_tiers[region].mark_own(rloc)
        self.used = sum(e[3] for e in self.entries.values()) * self.sb.unit if self.sb else 0
        self.objects = len(self.entries)
        for h in self.held_tiers.values():
            self.used += h.own_used
            self.objects += len(h.own)

    async def scan(self):
        async for item in super().scan():
            yield item
        for region, h in sorted(self.held_tiers.items()):
            for slot in sorted(h.own):
                if slot in h.entries:
                    oid, _start, size, _units, _hu = h.entries[slot]
                    yield oid, held_loc(region, h.loc_of(slot)), size
