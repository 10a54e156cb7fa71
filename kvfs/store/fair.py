"""Fair eviction between namespaces: per tier, each namespace's objects in LRU order and the
bytes it holds there, and which namespace gives up the next victim when the tier is full.

The rule (docs/operations.md, "Fair eviction"): the victim comes from the namespace whose use
of the tier is furthest above its share, measured as ``bytes on the tier / weight``; within it,
least recently used first. A namespace's weight is its quota when it has one; the others share
what the quotas leave of the store's total capacity equally (never less than an equal split of
that capacity between all the namespaces on the tier). With no quotas every weight is equal, so
the namespace holding the most of the tier loses blocks first and a small namespace keeps its
blocks while a big one writes.

The choice costs O(log namespaces) per victim: a heap of (-ratio, stamp, namespace) entries,
one pushed each time a namespace's bytes on the tier change; an entry whose stamp is no longer
its namespace's is stale and skipped. The heap is rebuilt when the weights change (a quota is
set, or a namespace appears on or leaves a tier while quotas exist) and when stale entries
outnumber live ones.
"""
from __future__ import annotations

import collections
import heapq
import logging
from typing import TYPE_CHECKING, Callable, Iterator

from kvfs.telemetry import namespace_of

if TYPE_CHECKING:
    from kvfs.store.objects import Obj

log = logging.getLogger(__name__)


class Shares:
    """What the weights come from, shared by every tier: quotas and the total capacity."""

    def __init__(self, capacity: Callable[[], int]):
        self.capacity = capacity
        self.quotas: dict[str, int] = {}
        self.version = 0              # bumped when a quota changes: heaps rebuild

    def set_quotas(self, quotas: dict[str, int]) -> None:
        if quotas != self.quotas:
            self.quotas = {ns: max(1, int(q)) for ns, q in quotas.items()}
            self.version += 1


class TierLRU:
    """One tier's objects by namespace, least recently used first, with each namespace's bytes."""

    def __init__(self, shares: Shares):
        self.shares = shares
        self.by_ns: dict[str, collections.OrderedDict[int, int]] = {}   # ns -> oid -> size
        self.used: dict[str, int] = {}
        self._stamp: dict[str, int] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._next = 0
        self._default = 1.0           # weight of a namespace without a quota
        self._built = (-1, -1)        # (shares.version, self._members) the heap was built for
        self._members = 0             # bumped when a namespace appears or leaves (quotas only)

    def __len__(self) -> int:
        return sum(len(d) for d in self.by_ns.values())

    def __contains__(self, oid: int) -> bool:
        return any(oid in d for d in self.by_ns.values())

    def __iter__(self) -> Iterator[int]:
        """Every oid on the tier: namespace by namespace (by name), each least recently used first."""
        for ns in sorted(self.by_ns):
            yield from self.by_ns[ns]

    def objects(self, ns: str) -> list[int]:
        """``ns``'s objects on this tier, least recently used first."""
        return list(self.by_ns.get(ns, ()))

    # ---- membership ------------------------------------------------------------------
    def add(self, obj: Obj) -> None:
        ns = namespace_of(obj.key)
        d = self.by_ns.get(ns)
        if d is None:
            d = self.by_ns[ns] = collections.OrderedDict()
            self.used[ns] = 0
            if self.shares.quotas:
                self._members += 1
        elif obj.oid in d:
            d.move_to_end(obj.oid)
            return
        d[obj.oid] = obj.size
        self._account(ns, obj.size)

    def merge_older(self, cold: dict[int, tuple[str, int]]) -> None:
        """Objects found by the background scan after a clean mount (oid -> (namespace, size),
        oldest first) go before those used since the mount, which stay more recently used."""
        found: dict[str, collections.OrderedDict[int, int]] = {}
        for oid, (ns, size) in cold.items():
            if oid not in self.by_ns.get(ns, ()):
                found.setdefault(ns, collections.OrderedDict())[oid] = size
        for ns, d in found.items():
            cur = self.by_ns.get(ns)
            if cur is None:
                self.used[ns] = 0
                if self.shares.quotas:
                    self._members += 1
            else:
                d.update(cur)
            self.by_ns[ns] = d
            self._account(ns, sum(d[o] for o in d if cur is None or o not in cur))

    def discard(self, obj: Obj) -> None:
        self._remove(namespace_of(obj.key), obj.oid)

    def touch(self, obj: Obj) -> None:
        d = self.by_ns.get(namespace_of(obj.key))
        if d is not None and obj.oid in d:
            d.move_to_end(obj.oid)

    def _remove(self, ns: str, oid: int) -> None:
        d = self.by_ns.get(ns)
        if d is None:
            return
        size = d.pop(oid, None)
        if size is None:
            return
        if not d:
            del self.by_ns[ns], self.used[ns], self._stamp[ns]
            if self.shares.quotas:
                self._members += 1
            return
        self._account(ns, -size)

    def _account(self, ns: str, delta: int) -> None:
        self.used[ns] += delta
        self._push(ns)
        if len(self._heap) > 2 * len(self.used) + 64:
            self._rebuild()

    # ---- the heap ----------------------------------------------------------------------
    def _weight(self, ns: str) -> float:
        q = self.shares.quotas.get(ns)
        return float(q) if q is not None else self._default

    def _push(self, ns: str) -> None:
        self._next += 1
        self._stamp[ns] = self._next
        heapq.heappush(self._heap, (-self.used[ns] / self._weight(ns), self._next, ns))

    def _rebuild(self) -> None:
        quotas = self.shares.quotas
        if quotas:
            total = max(1, self.shares.capacity())
            quoted = [ns for ns in self.used if ns in quotas]
            free = [ns for ns in self.used if ns not in quotas]
            if free:
                left = total - sum(quotas[ns] for ns in quoted)
                self._default = max(left / len(free), total / len(self.used), 1.0)
        self._built = (self.shares.version, self._members)
        self._heap = []
        self._stamp = {}
        for ns in self.used:
            self._push(ns)

    def ranked(self) -> Iterator[tuple[str, collections.OrderedDict[int, int]]]:
        """Namespaces on this tier, furthest above their share first, with their LRU lists.
        Close the iterator when done (entries it took from the heap go back)."""
        if self._built != (self.shares.version, self._members):
            self._rebuild()
        taken: list[tuple[float, int, str]] = []
        seen: set[str] = set()
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                ns = entry[2]
                if self._stamp.get(ns) != entry[1] or ns in seen:
                    continue              # stale: the namespace's bytes changed since
                taken.append(entry)
                seen.add(ns)
                yield ns, self.by_ns[ns]
        finally:
            for entry in taken:
                heapq.heappush(self._heap, entry)

    def drop_stale(self, ns: str, oid: int) -> None:
        """Remove an entry whose object is gone or no longer on this tier (a bug elsewhere)."""
        self._remove(ns, oid)
