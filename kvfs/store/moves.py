"""Moving objects between tiers: eviction, demotion, promotion and the write-down of
RAM-only objects at a clean unmount; a mixin of ``ObjectStore`` (kvfs/store/objects.py).
What to move and when is policy.py's.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from kvfs.errors import CorruptObject, NoSuchObject, TierFull, TierUnavailable, TierWriteFailed

if TYPE_CHECKING:
    from kvfs.store.objects import Obj

log = logging.getLogger(__name__)


class Moves:
    """Eviction, demotion, promotion and write-down (``ObjectStore`` mixin)."""

    async def evict(self, obj: Obj) -> None:
        log.debug("evicting %x (%s)", obj.oid, obj.key)
        for name in obj.place:
            self.counters[name].evictions += 1
        self.events.emit("evicted", obj, None)
        await self.lose(obj)

    async def demote(self, obj: Obj, i: int, *, evict_ok: bool = True) -> None:
        """Move ``obj`` off tier ``i``: copy it to the next reachable tier below unless one
        below already holds it. With no reachable tier below, a copy on an unreachable
        one (remote target down) still counts: the object reads again when it returns."""
        src = self.tiers[i]
        below = [t for t in self.tiers[i + 1:] if t.available]
        obj.busy = True
        copied = False
        try:
            # an empty object needs no copy anywhere (it reads as empty with no place): a file
            # written for it would be one more on the tier than its records count
            if obj.size and not any(t.name in obj.place for t in below) and (
                    below or not self._copy_below(obj, i)):
                if not below:
                    raise TierFull("no tier to demote to")
                j = self.tiers.index(below[0])
                dst = self.tiers[j]
                await self.make_room(j, dst.footprint(obj.size), evict_ok=evict_ok)
                if obj.dead:                   # dropped while room was made
                    return
                self.rekey(obj)
                data = await self.read_all(obj)
                if obj.dead:
                    return
                loc = await self._put(j, obj, data)
                del data
                self.counters[dst.name].bytes_written += obj.size
                if obj.dead:
                    await dst.delete(obj.oid, loc)
                    return
                obj.place[dst.name] = loc
                self.lru[dst.name].add(obj)
                copied = True
            if obj.dead:
                return
            if src.name not in obj.place:      # its copy here went meanwhile: record the new one
                if copied:
                    with self.index.write() as txn:
                        txn.put_object(obj.oid, obj.record())
                return
            # opened or leased while the copy was made: a loader may be about to read this
            # copy's backing file, so it stays (both copies recorded; a later pass drops it)
            keep = obj.refs > 0
            if keep:
                log.debug("demotion of %x: kept its %s copy (in use)", obj.oid, src.name)
            else:
                loc = obj.place.pop(src.name)
                self.lru[src.name].discard(obj)
            with self.index.write() as txn:
                txn.put_object(obj.oid, obj.record())
            if not keep:
                self.events.emit("demoted", obj, next((t.name for t in self.tiers[i + 1:] if t.name in obj.place), None))
                self.counters[src.name].demotions += 1
                if not src.volatile:
                    self.index.commit()     # the new placement is in LMDB before this copy goes
                await src.delete(obj.oid, loc)
        finally:
            obj.busy = False

    async def promote(self, obj: Obj) -> None:
        if obj.dead or obj.busy or self.ram.name in obj.place or obj.size > self.ram.capacity * self.low:
            return
        obj.busy = True
        try:
            data = await self.read_all(obj)
            if obj.dead:
                return
            if self.ram.free() < obj.size:
                # a promotion only speeds reads up: while a tier is unreachable it must not
                # push an object out of the hierarchy (its lower copy may be the only one left)
                await self.make_room(0, obj.size, evict_ok=all(t.available for t in self.tiers))
            if obj.dead:
                return
            loc = await self.ram.put(obj.info(), data)
            if obj.dead:                       # dropped (renamed over, unlinked) meanwhile
                await self.ram.delete(obj.oid, loc)
                return
            obj.place[self.ram.name] = loc
            self.lru[self.ram.name].add(obj)
            src = self.top_tier_below_ram(obj)
            self.counters[src].promotions += 1
            self.events.emit("promoted", obj, self.ram.name)
            # RAM copies are volatile: the index keeps only durable placements
        except (TierFull, TierUnavailable, TierWriteFailed, CorruptObject, NoSuchObject) as e:
            log.debug("promotion of %x skipped: %s", obj.oid, e)
        finally:
            obj.busy = False

    def top_tier_below_ram(self, obj: Obj) -> str:
        return next((t.name for t in self.tiers[1:] if t.name in obj.place), self.ram.name)

    async def write_down_volatile(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Copy objects whose only copy is in RAM to a durable tier (clean unmount).

        Their closes succeeded: they are kept if any durable tier can take them, making
        room there the way pressure does (least recently used first; on a filesystem
        fuller than its budget says, too). Least recently used RAM objects go first, so
        the newest survive when not all fit. What cannot be kept is logged, with a count.
        """
        todo = sorted((o for o in self.objs.loaded() if o.size and set(o.place) == {self.ram.name}),
                      key=lambda o: o.atime)
        lost = 0
        lower = self.tiers[1:]
        for t in lower:             # one sync of each tier at the end, not two per file
            t.defer_sync = True
        try:
            for n, obj in enumerate(todo):
                if not obj.dead and set(obj.place) == {self.ram.name}:
                    try:
                        await self._write_down(obj)
                    except (TierFull, TierUnavailable, TierWriteFailed, CorruptObject, NoSuchObject) as e:
                        lost += 1
                        log.error("could not keep %s across the restart: %s", obj.key or hex(obj.oid), e)
                if progress:
                    progress(n + 1, len(todo))
        finally:
            for t in lower:
                t.defer_sync = False
            for t in lower:
                if t.available:
                    await t.sync_deferred()
        self.unkept = lost          # the daemon's unmount report (kvfs umount's exit status)
        if lost:
            log.error("%d of %d RAM-only files could not be written to a durable tier and are lost",
                      lost, len(todo))
        return len(todo)

    async def _write_down(self, obj: Obj) -> None:
        """Put ``obj`` on the first durable tier that takes it (trying each in turn)."""
        self.rekey(obj)
        data = await self.read_all(obj)
        errors = []
        for i in range(1, len(self.tiers)):
            tier = self.tiers[i]
            if not tier.available:
                continue
            if tier.footprint(obj.size) > tier.capacity:    # evict nothing for what never fits
                errors.append(f"{tier.name} tier: {obj.size} bytes exceed its capacity")
                continue
            try:
                if tier.footprint(obj.size) > tier.free():
                    if i < self._lowest():
                        raise TierFull(f"{tier.name} tier is full")
                    await self.make_room(i, tier.footprint(obj.size))
                loc = await self._put(i, obj, data)
            except (TierFull, TierWriteFailed) as e:
                errors.append(str(e))
                continue
            obj.place[tier.name] = loc
            self.lru[tier.name].add(obj)
            self.counters[tier.name].bytes_written += obj.size
            with self.index.write() as txn:
                txn.put_object(obj.oid, obj.record())
            return
        raise TierFull("; ".join(errors) or "no durable tier is available")
