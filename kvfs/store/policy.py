"""Placement policy: when a tier is under pressure (watermarks), which object leaves it
(victim choice), whether the tier below admits it, and how room is made; a mixin of
``ObjectStore`` (kvfs/store/objects.py). The moves themselves are in moves.py.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from kvfs.errors import CorruptObject, NoSuchObject, TierFull, TierUnavailable, TierWriteFailed
from kvfs.store.tier import Tier

if TYPE_CHECKING:
    from kvfs.store.objects import Obj

log = logging.getLogger(__name__)


class Policy:
    """Watermarks, victim choice, admission and making room (``ObjectStore`` mixin)."""

    # ---- pressure: demotion and eviction -----------------------------------
    def kick(self) -> None:
        for t in self.tiers:
            if t.used > t.capacity * self.high:
                self._kick.set()
                return

    def _lowest(self) -> int:
        return max(i for i, t in enumerate(self.tiers) if t.available)

    def _copy_below(self, obj: Obj, i: int) -> bool:
        """True when a tier below ``i`` (reachable or not) holds a durable copy of ``obj``."""
        return any(t.name in obj.place for t in self.tiers[i + 1:])

    def _victim(self, tier: Tier, evict: bool) -> Obj | None:
        """The next object to leave ``tier``: from the namespace furthest above its fair share
        (kvfs/store/fair.py), least recently used first within it."""
        i = self.tiers.index(tier)
        # On the lowest *reachable* tier with an unreachable one below it (remote target
        # down), first take objects that also live down there: dropping this copy loses
        # nothing, they read again when the tier comes back.
        degraded = evict and i < len(self.tiers) - 1
        fallback = None
        with contextlib.closing(self.lru[tier.name].ranked()) as ranked:
            for ns, lru in ranked:
                found, first = self._victim_in(tier, ns, lru, evict, degraded, i)
                if found is not None:
                    return found
                if fallback is None:
                    fallback = first
        return fallback

    def _victim_in(self, tier: Tier, ns: str, lru, evict: bool, degraded: bool, i: int):
        """(victim, fallback) among one namespace's objects on ``tier``, LRU first."""
        stale, fallback = [], None
        try:
            for oid in lru:
                obj = self.objs.get(oid)
                if obj is None or obj.dead or tier.name not in obj.place:
                    stale.append(oid)
                    continue
                if obj.refs or obj.busy:
                    continue
                if degraded and not obj.pinned and self._copy_below(obj, i):
                    return obj, None
                if evict and (obj.pinned or not self.may_evict(obj)):
                    continue
                if not degraded:
                    return obj, None
                if fallback is None:
                    fallback = obj
            return None, fallback
        finally:
            for oid in stale:
                log.error("dropping a stale %s LRU entry %x", tier.name, oid)   # a bug elsewhere
                self.lru[tier.name].drop_stale(ns, oid)

    async def _make_way(self, victim: Obj, i: int, evict_ok: bool) -> None:
        """Move ``victim`` off tier ``i``: demote it, drop a copy that also lives below, or evict it."""
        if (evict_ok and not victim.pinned and not self._copy_below(victim, i)
                and self.may_evict(victim) and not self.admitted(victim, i)):
            await self.evict(victim)
        elif i < self._lowest() or self._copy_below(victim, i):
            await self.demote(victim, i, evict_ok=evict_ok)
        elif evict_ok:
            await self.evict(victim)
        else:
            raise TierFull(f"{self.tiers[i].name} tier is full and a lower tier is unavailable")

    def admitted(self, obj: Obj, i: int) -> bool:
        """May ``obj`` be demoted off tier ``i``? Each tier may ask for ``admit_after`` uses
        (its write plus its opens) before it takes an object (default 1: everything); one
        that the next reachable tier would not admit is dropped instead, counted per tier."""
        below = next((t for t in self.tiers[i + 1:] if t.available), None)
        if below is None or 1 + obj.hits >= self.admit_after.get(below.name, 1):
            return True
        self.telemetry.not_admitted(below.name)
        return False

    async def make_room(self, i: int, need: int, *, evict_ok: bool = True) -> None:
        """Demote (or, on the lowest reachable tier, evict) until tier ``i`` has ``need`` bytes free.

        ``evict_ok=False`` (promotions while a tier is unavailable) never destroys an
        object: it raises TierFull instead of evicting.
        """
        tier = self.tiers[i]
        if i and tier.free() < need:
            await self.wait_loaded()        # a durable tier's LRU is complete once scanned
        while tier.free() < need:
            victim = self._victim(tier, i >= self._lowest())
            if victim is None:
                raise TierFull(f"{tier.name} tier is full and what remains is pinned or in use")
            await self._make_way(victim, i, evict_ok)

    async def relieve(self) -> None:
        """Bring every tier above its high watermark down to the low one."""
        for i, tier in enumerate(self.tiers):
            if not tier.available or tier.used <= tier.capacity * self.high:
                continue
            target = tier.capacity * self.low
            if i:
                await self.wait_loaded()
            while tier.used > target:
                victim = self._victim(tier, i >= self._lowest())
                if victim is None:
                    break
                try:
                    await self._make_way(victim, i, True)
                except (TierFull, TierUnavailable, TierWriteFailed) as e:
                    # a failed write below leaves the victim where it was: nothing has to go now
                    log.warning("cannot relieve %s tier: %s", tier.name, e)
                    break
                except (CorruptObject, NoSuchObject) as e:    # the victim's bytes are gone
                    log.warning("relieving %s tier: %x: %s", tier.name, victim.oid, e)
                    if not victim.dead:
                        break
