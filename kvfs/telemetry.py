"""Counters the daemon keeps for operators: latency histograms, per-namespace usage, admission
and read-deadline counts, and the KV event hub.

Everything here is updated on the trio thread by plain integer arithmetic (no locks, no
allocation on the hot path); the Prometheus collector (kvfs.metrics) and ``kvfs top`` read a
snapshot of it. The store and the filesystem hold one :class:`Telemetry` (``store.telemetry``).

A *namespace* is the top-level directory of the mount: the KV layer's per-model directory
(kvfs.kv.layout), or whatever a runtime writes under one. Files at the root count as ``/``.
"""
from __future__ import annotations

import bisect
import logging
import time

from kvfs.events import EventHub

log = logging.getLogger(__name__)

# seconds: 10 µs .. 10 s, roughly x2.5 per bucket (FUSE round trips here are 20-200 µs)
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCIES = ("lookup", "lease", "read", "write", "seal")
MAX_NAMESPACES = 1000       # namespaces counted by name; the rest are counted together as OTHER
OTHER = "(other)"


class Histogram:
    """Fixed buckets (upper bounds, inclusive, in seconds) plus +Inf, a sum and a count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def snapshot(self) -> dict:
        """``{"buckets": [[le, cumulative count], ...], "sum": s, "count": n}`` (le "+Inf" last)."""
        out, acc = [], 0
        for le, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            acc += n
            out.append([le, acc])
        return {"buckets": out, "sum": self.sum, "count": self.count}


class NamespaceCounters:
    __slots__ = ("bytes", "blocks", "hits", "misses")

    def __init__(self):
        self.bytes = self.blocks = self.hits = self.misses = 0

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "blocks": self.blocks, "hits": self.hits, "misses": self.misses}


def namespace_of(path: str) -> str:
    """The top-level directory of a mount path (``/a/b/c`` -> ``a``; ``/c`` -> ``/``)."""
    head, sep, _ = path.lstrip("/").partition("/")
    return head if sep else "/"


class Telemetry:
    def __init__(self):
        self.latency = {name: Histogram() for name in LATENCIES}
        self.namespaces: dict[str, NamespaceCounters] = {}
        self.admission_dropped: dict[str, int] = {}  # tier not admitted to -> objects dropped
        self.deadline_exceeded: dict[str, int] = {}  # tier -> reads that ran past read_deadline
        self.events = EventHub()
        self.started = time.time()

    # ---- namespaces -------------------------------------------------------------
    def _ns(self, name: str) -> tuple[str, NamespaceCounters]:
        c = self.namespaces.get(name)
        if c is None:
            if len(self.namespaces) >= MAX_NAMESPACES:    # bounded label set: the rest share one
                name = OTHER
                c = self.namespaces.get(name)
            if c is None:
                c = self.namespaces[name] = NamespaceCounters()
        return name, c

    def adopt(self, size: int, path: str) -> None:
        """An object at ``path`` became part of the store (sealed, or loaded at start)."""
        c = self._ns(namespace_of(path))[1]
        c.bytes += size
        c.blocks += 1

    def forget(self, size: int, path: str) -> None:
        """The object adopted at ``path`` left the store."""
        c = self._ns(namespace_of(path))[1]
        c.bytes -= size
        c.blocks -= 1

    def rekey(self, size: int, old: str, new: str) -> None:
        """The store learnt the object's current path (renamed since it was adopted)."""
        if namespace_of(old) != namespace_of(new):
            self.forget(size, old)
            self.adopt(size, new)

    def totals(self) -> dict[str, list[int]]:
        """Bytes and blocks per namespace (what ``restore`` takes back at the next mount)."""
        return {name: [c.bytes, c.blocks] for name, c in self.namespaces.items() if c.blocks or c.bytes}

    def restore(self, totals: dict) -> None:
        """Add the ``totals`` a clean unmount recorded (the objects the store did not load)."""
        for name, (size, blocks) in totals.items():
            c = self._ns(name)[1]
            c.bytes += size
            c.blocks += blocks

    def hit(self, path: str) -> None:
        self._ns(namespace_of(path))[1].hits += 1

    def miss(self, path: str) -> None:
        self._ns(namespace_of(path))[1].misses += 1

    def miss_in(self, namespace: str) -> None:
        """A miss in ``namespace`` (a top-level directory's name, or ``/``)."""
        self._ns(namespace)[1].misses += 1

    # ---- admission and deadlines ---------------------------------------------------
    def not_admitted(self, tier: str) -> None:
        self.admission_dropped[tier] = self.admission_dropped.get(tier, 0) + 1

    def deadline(self, tier: str) -> None:
        self.deadline_exceeded[tier] = self.deadline_exceeded.get(tier, 0) + 1

    def snapshot(self) -> dict:
        return {
            "latency": {k: h.snapshot() for k, h in self.latency.items()},
            "namespaces": {k: c.as_dict() for k, c in self.namespaces.items()},
            "admission_dropped": dict(self.admission_dropped),
            "deadline_exceeded": dict(self.deadline_exceeded),
            "events": self.events.statistics(),
        }
