"""Extent allocator over the data units of a volume, and the slot allocator of the table.

Free space is a sorted list of (start, length) extents, merged on free; allocation
is next-fit from a rover (so a stream of puts writes sequentially and freed space
is reused when the rover comes around). Rebuilt at open from the live table entries.
"""
from __future__ import annotations

import bisect
import heapq


class ExtentAllocator:
    def __init__(self, start: int, length: int):
        self.start, self.end = start, start + length
        self._starts: list[int] = [start]
        self._lens: list[int] = [length]
        self.free_units = length
        self._rover = start

    @classmethod
    def from_used(cls, start: int, length: int, used: list[tuple[int, int]]) -> "ExtentAllocator":
        """Free map = the region minus ``used`` extents; raises ValueError on overlap/out of range."""
        a = cls(start, 0)
        a._starts, a._lens = [], []
        pos = start
        for s, n in sorted(used):
            if s < pos or s + n > start + length or n <= 0:
                raise ValueError(f"extent [{s}, +{n}) overlaps another or lies outside the data area")
            if s > pos:
                a._starts.append(pos)
                a._lens.append(s - pos)
            pos = s + n
        if pos < start + length:
            a._starts.append(pos)
            a._lens.append(start + length - pos)
        a.end = start + length
        a.free_units = sum(a._lens)
        return a

    def alloc(self, n: int) -> int | None:
        """Next-fit: the first extent at or after the rover that holds n units, wrapping once."""
        if n <= 0 or n > self.free_units:
            return None
        k = len(self._starts)
        first = bisect.bisect_left(self._starts, self._rover)
        for j in range(k):
            i = (first + j) % k
            s, ln = self._starts[i], self._lens[i]
            if ln < n:
                continue
            if ln == n:
                del self._starts[i], self._lens[i]
            else:
                self._starts[i], self._lens[i] = s + n, ln - n
            self.free_units -= n
            self._rover = s + n
            return s
        return None

    def free(self, s: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, s)
        if i < len(self._starts) and self._starts[i] < s + n:
            raise ValueError(f"double free of [{s}, +{n})")
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] > s:
            raise ValueError(f"double free of [{s}, +{n})")
        merge_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == s
        merge_next = i < len(self._starts) and self._starts[i] == s + n
        if merge_prev and merge_next:
            self._lens[i - 1] += n + self._lens[i]
            del self._starts[i], self._lens[i]
        elif merge_prev:
            self._lens[i - 1] += n
        elif merge_next:
            self._starts[i], self._lens[i] = s, self._lens[i] + n
        else:
            self._starts.insert(i, s)
            self._lens.insert(i, n)
        self.free_units += n

    def extents(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lens))


class SlotAllocator:
    """Lowest-free-first table slots (keeps the live part of the table dense)."""

    def __init__(self, slots: int, used: set[int] = frozenset()):
        self.slots = slots
        self._free = [i for i in range(slots) if i not in used]
        heapq.heapify(self._free)

    def alloc(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def free(self, i: int) -> None:
        heapq.heappush(self._free, i)

    def __len__(self) -> int:
        return len(self._free)
