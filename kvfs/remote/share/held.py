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
from typing import Awaitable, Callable

import trio

from kvfs.errors import ConfigError, NoSuchObject, TierFull, TierUnavailable
from kvfs.remote.share import format as F
from kvfs.remote.share.member import write_unit
from kvfs.remote.share.region import RegionVolume
from kvfs.remote.share.view import SharedView
from kvfs.remote.tier import _LOC, RemoteTier
from kvfs.remote.volume import Volume
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


class HeldRegions:
    """The regions a SharedRemoteTier took over from dead nodes: ``held`` (each one's origin
    and ``writable_at``) and ``tiers`` (those of them open for writing). It opens them, puts
    into them when the tier's own region is full, reclaims the dead node's records there, frees
    the node's own records there, counts and lists them.

    What it needs of the shared tier comes in as arguments: ``parent`` (the shared volume),
    ``owner`` (the node's instance id), ``guard`` (the write check every region volume calls),
    ``clock`` (the failure detector's), ``publish`` (async: appends a put or free to the node's
    log), ``count`` (adds bytes and objects to the tier's totals) and ``view`` (the tier's
    SharedView, which a reclaimed record leaves at once)."""

    def __init__(self, parent: Volume, *, owner: str, guard: Callable[[], None], clock: Callable[[], float],
                 publish: Callable[..., Awaitable[None]], count: Callable[[int, int], None], view: SharedView):
        self.parent = parent
        self.owner = owner
        self.guard = guard
        self.clock = clock
        self.publish = publish
        self.count = count
        self.view = view
        self.held: dict[int, dict] = {}            # regions taken over from dead nodes -> what and when
        self.tiers: dict[int, HeldRegion] = {}     # those of them open for writing
        self.lock = trio.Lock()

    def capacity(self) -> int:
        """The data area of every held region we may write in now (before ``writable_at`` a
        held region adds nothing: the store must not count on its room)."""
        now = self.clock()
        return sum(h.capacity for h in self.tiers.values() if now >= h.writable_at)

    async def open(self, region: int, sb2: F.Superblock2 | None) -> None:
        """Open a held region's format-1 volume (reads only) so this node may reclaim the dead
        node's records there and put its own, from ``writable_at`` on."""
        if region in self.tiers or sb2 is None:
            return
        rv = RegionVolume(self.parent, sb2.region_off(region), sb2.region_bytes)
        rv.guard = self.guard
        h = HeldRegion(rv, region=region, owner=self.owner, writable_at=self.held[region]["writable_at"])
        try:
            await h.open()
        except (ConfigError, ValueError, TierUnavailable) as e:
            log.error("held region %d stays read-only: %s", region, e)
            return
        self.tiers[region] = h
        log.info("held region %d: %d inherited records (%d bytes), writable in %.1f s", region,
                 len(h.inherited()), sum(e[3] for _s, e in h.inherited()) * h.unit,
                 max(0.0, h.writable_at - self.clock()))

    async def reload(self) -> None:
        """After a reconnect: same region volumes, deletes applied."""
        for h in self.tiers.values():
            await h.reload()

    async def put(self, info: ObjectInfo, data: memoryview) -> bytes:
        """Our region is full: put into a held region, first freeing as many of the dead node's
        records there as the new one needs (each free published in our log)."""
        async with self.lock:     # one reclaim at a time: a header is zeroed only before its space is free
            return await self._put_locked(info, data)

    async def _put_locked(self, info: ObjectInfo, data: memoryview) -> bytes:
        for region, h in sorted(self.tiers.items()):
            if self.clock() < h.writable_at or not h.available or h.footprint(info.size) > h.capacity:
                continue
            while not h.fits(info.size) and h.inherited():
                await self._reclaim(h, *h.inherited()[0])
            if not h.fits(info.size):
                continue
            rloc = await h.put(info, data)
            units = _LOC.unpack(rloc)[3]
            self.count(units * h.unit, 1)
            await self.publish(F.OP_PUT, info.oid, rloc, info, region, h.sb.volume_uuid)
            return held_loc(region, rloc)
        raise TierFull("remote tier: no room in our region or the regions we hold")

    async def _reclaim(self, h: HeldRegion, slot: int, entry: tuple) -> None:
        """Free one inherited record of a held region as its owner: publish the free, zero its
        header (a reader by location misses from now on), free its table entry."""
        oid, start, _size, _units, _hu = entry
        rloc = h.loc_of(slot)
        await self.publish(F.OP_FREE, oid, rloc, None, h.region, h.sb.volume_uuid)
        await write_unit(h.vol, start * h.unit, bytes(h.unit), h.unit)
        await h.delete(oid, rloc)          # counts it in h.reclaimed
        victim = self.held[h.region]["from_slot"]
        self.view.apply(victim, "", F.LogEntry(0, 0, F.OP_FREE, h.region, start, oid=oid))

    def record(self, oid: int, loc: bytes) -> tuple[HeldRegion, bytes, int, int] | None:
        """(held region, its loc, start unit, units) of a live record of ours at held-region
        ``loc``, or None (its region not open, or no such record)."""
        region, rloc = unpack_held_loc(loc)
        h = self.tiers.get(region)
        if h is None:
            return None
        try:
            _slot, (_oid, start, _size, units, _hu) = h.entry(oid, rloc)
        except NoSuchObject:
            return None
        return h, rloc, start, units

    async def free(self, oid: int, h: HeldRegion, rloc: bytes, start: int, units: int) -> None:
        """Free one of our records in a held region (its ``record``): publish the free, clear
        its header, free its table entry."""
        await self.publish(F.OP_FREE, oid, rloc, None, h.region, h.sb.volume_uuid)
        try:
            await write_unit(h.vol, start * h.unit, bytes(h.unit), h.unit)
        except TierUnavailable as e:
            log.warning("could not clear the record header of object %x: %s", oid, e)
        await h.delete(oid, rloc)
        self.count(-units * h.unit, -1)

    def mark_own(self, locs) -> None:
        """After the store loaded (``locs``: every loc the index holds on the tier): our own
        records in the held regions (the others stay inherited)."""
        for loc in locs:
            if is_held_loc(loc):
                region, rloc = unpack_held_loc(loc)
                if region in self.tiers:
                    self.tiers[region].mark_own(rloc)

    def own_totals(self) -> tuple[int, int]:
        """(bytes, objects) of our own records in the held regions."""
        return (sum(h.own_used for h in self.tiers.values()), sum(len(h.own) for h in self.tiers.values()))

    async def scan(self):
        """(oid, held-region loc, size) of our own records in the held regions."""
        for region, h in sorted(self.tiers.items()):
            for slot in sorted(h.own):
                if slot in h.entries:
                    oid, _start, size, _units, _hu = h.entries[slot]
                    yield oid, held_loc(region, h.loc_of(slot)), size

    def status(self) -> dict:
        """The ``held`` part of the share status: per region, where it came from, whether we
        may write there now, and (when open) its use."""
        return {str(r): {**{k: v for k, v in h.items() if k != "writable_at"},
                         "writable": r in self.tiers and self.clock() >= h["writable_at"],
                         **(describe(self.tiers[r]) if r in self.tiers else {})}
                for r, h in self.held.items()}
