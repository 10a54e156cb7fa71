"""Moving objects between tiers: eviction, demotion, promotion, making room, and the
write-down of RAM-only objects at a clean unmount. Which object leaves a tier, how (demoted
or evicted), when relief is due and what is promoted are the policy's (kvfs.store.policy):
the mover asks it and acts.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from kvfs.errors import CorruptObject, NoSuchObject, TierFull, TierUnavailable, TierWriteFailed
from kvfs.store.fair import TierLRU
from kvfs.store.index import Index
from kvfs.store.policy import Policy
from kvfs.store.tier import Tier
from kvfs.events import EventHub

if TYPE_CHECKING:
    from kvfs.store.objects import Obj, TierCounters
    from kvfs.store.objtable import ObjTable

log = logging.getLogger(__name__)


class Mover:
    """Eviction, demotion, promotion and write-down over the store's tiers (top first).

    ``read_all``: an object's verified bytes; ``lose``: drop an object and its name;
    ``rekey``: refresh an object's key before it is written to a tier; ``wait_loaded``: wait
    for the object table's background scan (a durable tier's LRU order is complete after it);
    ``dropping``: told an object's id before one of its copies is freed (or, promoted, stops
    being its top copy).
    """

    def __init__(self, tiers: list[Tier], ram: Tier, index: Index, objs: ObjTable, *,
                 lru: dict[str, TierLRU], counters: dict[str, TierCounters], events: EventHub,
                 policy: Policy, read_all: Callable[[Obj], Awaitable[memoryview]],
                 lose: Callable[[Obj], Awaitable[None]], rekey: Callable[[Obj], None],
                 wait_loaded: Callable[[], Awaitable[None]],
                 dropping: Callable[[int], None] = lambda oid: None):
        self.tiers = tiers
        self.ram = ram
        self.index = index
        self.objs = objs
        self.lru = lru
        self.counters = counters
        self.events = events
        self.policy = policy
        self.read_all = read_all
        self.lose = lose
        self.rekey = rekey
        self.wait_loaded = wait_loaded
        self.dropping = dropping
        self.unkept = 0     # RAM-only objects the last write-down could not keep (kvfs umount's status)

    # ---- making room --------------------------------------------------------------
    async def make_room(self, i: int, need: int, *, evict_ok: bool = True) -> None:
        """Demote (or, on the lowest reachable tier, evict) until tier ``i`` has ``need`` bytes free.

        ``evict_ok=False`` (promotions while a tier is unavailable) never destroys an
        object: it raises TierFull instead of evicting.
        """
        tier = self.tiers[i]
        if tier.sized and need > tier.capacity:
            # more than the whole tier: evicting would empty it and still fail
            raise TierFull(f"{tier.name} tier: {need} bytes are more than its capacity ({tier.capacity})")
        if tier is not self.ram and tier.free() < need:
            await self.wait_loaded()        # a durable tier's LRU is complete once scanned
        while tier.free() < need:
            victim = self.policy.victim(tier)
            if victim is None:
                raise TierFull(f"{tier.name} tier is full and what remains is pinned or in use")
            await self.make_way(victim, i, evict_ok)

    async def make_way(self, victim: Obj, i: int, evict_ok: bool) -> None:
        """Move ``victim`` off tier ``i`` the way the policy says: demote it, drop a copy that
        also lives below, or evict it."""
        if self.policy.way(victim, i, evict_ok) == "evict":
            await self.evict(victim)
        else:
            await self.demote(victim, i, evict_ok=evict_ok)

    async def relieve(self) -> None:
        """Bring every tier above its high watermark down to the low one."""
        for i, tier in enumerate(self.tiers):
            if not tier.available or not self.policy.over_high(tier):
                continue
            target = self.policy.target(tier)
            if tier is not self.ram:
                await self.wait_loaded()
            while tier.used > target:
                victim = self.policy.victim(tier)
                if victim is None:
                    break
                try:
                    await self.make_way(victim, i, True)
                except (TierFull, TierUnavailable, TierWriteFailed) as e:
                    # a failed write below leaves the victim where it was: nothing has to go now
                    log.warning("cannot relieve %s tier: %s", tier.name, e)
                    break
                except (CorruptObject, NoSuchObject) as e:    # the victim's bytes are gone
                    log.warning("relieving %s tier: %x: %s", tier.name, victim.oid, e)
                    if not victim.dead:
                        break

    async def room_below(self, above: int, size: int) -> Tier:
        """The first available tier below index ``above`` that can take ``size`` bytes."""
        lower = [i for i in range(above + 1, len(self.tiers)) if self.tiers[i].available]
        if not lower:
            raise TierFull("no tier below RAM is available")
        for i in lower:
            t = self.tiers[i]
            if t.footprint(size) <= t.free():
                return t
        await self.make_room(lower[-1], self.tiers[lower[-1]].footprint(size))
        return self.tiers[lower[-1]]

    async def put(self, i: int, obj: Obj, data) -> bytes:
        """``tiers[i].put`` of ``obj``; when the tier's filesystem is fuller than its budget
        says (ENOSPC with room on the books), make room there as if it were full and retry.
        Any other OSError (EIO, EROFS) is counted in the tier's ``errors`` and raised as
        TierWriteFailed: the caller keeps the object where it was."""
        tier = self.tiers[i]
        while True:
            try:
                return await tier.put(obj.info(), data)
            except OSError as e:
                self.counters[tier.name].errors += 1
                log.warning("%s tier: writing object %x failed: %s", tier.name, obj.oid, e)
                raise TierWriteFailed(f"{tier.name} tier: write failed: {e}") from e
            except TierFull as e:
                if tier is self.ram or tier.free() < tier.footprint(obj.size):
                    raise                       # full on the books: the caller makes room
                await self.wait_loaded()
                victim = self.policy.victim(tier)
                if victim is None:
                    raise
                log.warning("%s; making room as if full (%s %x)", e,
                            "demoting" if i < self.policy.lowest() else "evicting", victim.oid)
                await self.make_way(victim, i, True)

    # ---- moves ----------------------------------------------------------------------
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
                    below or not self.policy.copy_below(obj, i)):
                if not below:
                    raise TierFull("no tier to demote to")
                copied = await self._copy_to(obj, self.tiers.index(below[0]), evict_ok)
                if not copied:
                    return
            if obj.dead:
                return
            if src.name not in obj.place:      # its copy here went meanwhile: record the new one
                if copied:
                    with self.index.write() as txn:
                        txn.put_object(obj.oid, obj.record())
                return
            await self._drop_copy(obj, i)
        finally:
            obj.busy = False

    async def _copy_to(self, obj: Obj, j: int, evict_ok: bool) -> bool:
        """Copy ``obj`` to tier ``j`` (making room there); False when it was dropped meanwhile."""
        dst = self.tiers[j]
        await self.make_room(j, dst.footprint(obj.size), evict_ok=evict_ok)
        if obj.dead:                   # dropped while room was made
            return False
        self.rekey(obj)
        data = await self.read_all(obj)
        if obj.dead:
            return False
        loc = await self.put(j, obj, data)
        del data
        self.counters[dst.name].bytes_written += obj.size
        if obj.dead:
            await dst.delete(obj.oid, loc)
            return False
        obj.place[dst.name] = loc
        self.lru[dst.name].add(obj)
        return True

    async def _drop_copy(self, obj: Obj, i: int) -> None:
        """The demotion's end: record the placement and free the copy on tier ``i``."""
        src = self.tiers[i]
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
            self.dropping(obj.oid)
            await src.delete(obj.oid, loc)

    async def promote(self, obj: Obj) -> None:
        if obj.dead or obj.busy or not self.policy.promotable(obj):
            return
        obj.busy = True
        try:
            data = await self.read_all(obj)
            if obj.dead:
                return
            if self.ram.free() < obj.size:
                await self.make_room(self.tiers.index(self.ram), obj.size,
                                     evict_ok=self.policy.promotion_may_evict())
            if obj.dead:
                return
            loc = await self.ram.put(obj.info(), data)
            if obj.dead:                       # dropped (renamed over, unlinked) meanwhile
                await self.ram.delete(obj.oid, loc)
                return
            obj.place[self.ram.name] = loc
            self.lru[self.ram.name].add(obj)
            self.dropping(obj.oid)             # the copy below is no longer the one to read
            src = self._top_below_ram(obj)
            self.counters[src].promotions += 1
            self.events.emit("promoted", obj, self.ram.name)
            # RAM copies are volatile: the index keeps only durable placements
        except (TierFull, TierUnavailable, TierWriteFailed, CorruptObject, NoSuchObject) as e:
            log.debug("promotion of %x skipped: %s", obj.oid, e)
        finally:
            obj.busy = False

    def _top_below_ram(self, obj: Obj) -> str:
        return next((t.name for t in self.tiers if t is not self.ram and t.name in obj.place), self.ram.name)

    # ---- the clean unmount's write-down -------------------------------------------------
    async def write_down_volatile(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Copy objects whose only copy is in RAM to a durable tier (clean unmount).

        Their closes succeeded: they are kept if any durable tier can take them, making
        room there the way pressure does (least recently used first; on a filesystem
        fuller than its budget says, too). Least recently used RAM objects go first, so
        the newest survive when not all fit. What cannot be kept is logged, with a count
        (``unkept``).
        """
        todo = sorted((o for o in self.objs.loaded() if o.size and set(o.place) == {self.ram.name}),
                      key=lambda o: o.atime)
        lost = 0
        lower = [t for t in self.tiers if t is not self.ram]
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
        self.unkept = lost
        if lost:
            log.error("%d of %d RAM-only files could not be written to a durable tier and are lost",
                      lost, len(todo))
        return len(todo)

    async def _write_down(self, obj: Obj) -> None:
        """Put ``obj`` on the first durable tier that takes it (trying each in turn)."""
        self.rekey(obj)
        data = await self.read_all(obj)
        errors = []
        for i, tier in enumerate(self.tiers):
            if tier is self.ram or not tier.available:
                continue
            if tier.footprint(obj.size) > tier.capacity:    # evict nothing for what never fits
                errors.append(f"{tier.name} tier: {obj.size} bytes exceed its capacity")
                continue
            try:
                if tier.footprint(obj.size) > tier.free():
                    if i < self.policy.lowest():
                        raise TierFull(f"{tier.name} tier is full")
                    await self.make_room(i, tier.footprint(obj.size))
                loc = await self.put(i, obj, data)
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
