"""Placement policy: what the store decides, never how it moves bytes (kvfs.store.moves).

- watermarks: when a tier is under pressure and how far relief brings it down;
- victims: which object leaves a full tier (the fairness rule, kvfs.store.fair, picks the
  namespace; least recently used first within it), and a namespace's idle files for its quota
  (kvfs.quota);
- where a victim goes: demoted to the tier below, or evicted (the prefix rule,
  kvfs.store.prefix, keeps a KV block whose descendants are cached; admission keeps an object
  off a tier that asks for more uses than it had);
- promotion: which opens copy an object up to RAM.

Both rules are objects given at construction: ``fair`` (tier name -> ``TierLRU``) and
``prefix`` (``PrefixRule``).
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Literal

from kvfs.errors import TierFull
from kvfs.store.fair import TierLRU
from kvfs.store.prefix import PrefixRule
from kvfs.store.tier import Tier
from kvfs.telemetry import Telemetry

if TYPE_CHECKING:
    from kvfs.store.objects import Obj
    from kvfs.store.objtable import ObjTable

log = logging.getLogger(__name__)


class Policy:
    """Watermarks, victim choice, admission and promotion over the store's tiers (top first)."""

    def __init__(self, tiers: list[Tier], ram: Tier, objs: ObjTable, *, fair: dict[str, TierLRU],
                 prefix: PrefixRule, telemetry: Telemetry, high: float, low: float, promote_hits: int,
                 promote_window: float, admit_after: dict[str, int] | None = None):
        self.tiers = tiers
        self.ram = ram
        self.objs = objs
        self.fair = fair
        self.prefix = prefix
        self.telemetry = telemetry
        self.high, self.low = high, low
        self.promote_hits, self.promote_window = promote_hits, promote_window
        self.admit_after = dict(admit_after or {})   # tier -> uses before an object may go there

    # ---- watermarks ---------------------------------------------------------------
    def over_high(self, tier: Tier) -> bool:
        return tier.used > tier.capacity * self.high

    def pressed(self) -> bool:
        """Some tier is above its high watermark (relief is due)."""
        return any(self.over_high(t) for t in self.tiers)

    def target(self, tier: Tier) -> float:
        """The bytes relief brings ``tier`` down to."""
        return tier.capacity * self.low

    # ---- victims ------------------------------------------------------------------
    def lowest(self) -> int:
        """The index of the lowest reachable tier."""
        return max(i for i, t in enumerate(self.tiers) if t.available)

    def copy_below(self, obj: Obj, i: int) -> bool:
        """True when a tier below ``i`` (reachable or not) holds a durable copy of ``obj``."""
        return any(t.name in obj.place for t in self.tiers[i + 1:])

    def victim(self, tier: Tier) -> Obj | None:
        """The next object to leave ``tier``: from the namespace furthest above its fair share
        (kvfs/store/fair.py), least recently used first within it. On the lowest reachable
        tier it leaves by eviction: the prefix rule and pinning keep an object there."""
        i = self.tiers.index(tier)
        evict = i >= self.lowest()
        # On the lowest *reachable* tier with an unreachable one below it (remote target
        # down), first take objects that also live down there: dropping this copy loses
        # nothing, they read again when the tier comes back.
        degraded = evict and i < len(self.tiers) - 1
        fallback = None
        with contextlib.closing(self.fair[tier.name].ranked()) as ranked:
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
                if degraded and not obj.pinned and self.copy_below(obj, i):
                    return obj, None
                if evict and (obj.pinned or not self.prefix.may_evict(obj)):
                    continue
                if not degraded:
                    return obj, None
                if fallback is None:
                    fallback = obj
            return None, fallback
        finally:
            for oid in stale:
                log.error("dropping a stale %s LRU entry %x", tier.name, oid)   # a bug elsewhere
                self.fair[tier.name].drop_stale(ns, oid)

    def namespace_victims(self, ns: str, keep: Obj | None = None) -> list[Obj]:
        """``ns``'s idle sealed files on any tier (not open, leased, pinned or moving, and not
        ``keep``), least recently used first; the prefix rule keeps a block whose descendants
        are cached, as under pressure (a quota's victims, kvfs.quota)."""
        objs = self.objs
        mine = {oid: objs[oid] for lru in self.fair.values() for oid in lru.objects(ns) if oid in objs}
        return sorted((o for o in mine.values()
                       if not (o.refs or o.pinned or o.busy or o.dead or o is keep)
                       and self.prefix.may_evict(o)),
                      key=lambda o: o.atime)

    # ---- where a victim goes --------------------------------------------------------
    def way(self, victim: Obj, i: int, evict_ok: bool) -> Literal["evict", "demote"]:
        """How ``victim`` leaves tier ``i``: evicted, or demoted (copied below, or its copy
        here dropped when one below holds it). ``evict_ok=False`` never evicts: TierFull
        instead when it cannot be demoted."""
        if (evict_ok and not victim.pinned and not self.copy_below(victim, i)
                and self.prefix.may_evict(victim) and not self.admitted(victim, i)):
            return "evict"
        if i < self.lowest() or self.copy_below(victim, i):
            return "demote"
        if evict_ok:
            return "evict"
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

    # ---- promotion --------------------------------------------------------------------
    def wants_promotion(self, obj: Obj, now: float) -> bool:
        """Count an open of ``obj`` in its promotion window; True when it is due to be
        copied up to RAM (``promote_hits`` opens within ``promote_window`` seconds)."""
        if now - obj.win_start > self.promote_window:
            obj.win_start, obj.win_count = now, 0
        obj.win_count += 1
        return bool(obj.size) and self.ram.name not in obj.place and obj.win_count >= self.promote_hits

    def promotable(self, obj: Obj) -> bool:
        """Not in RAM yet, and small enough for RAM's low watermark."""
        return self.ram.name not in obj.place and obj.size <= self.target(self.ram)

    def promotion_may_evict(self) -> bool:
        """A promotion only speeds reads up: while a tier is unreachable it must not push an
        object out of the hierarchy (its lower copy may be the only one left)."""
        return all(t.available for t in self.tiers)
