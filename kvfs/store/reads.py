"""Verified reads of sealed objects: RAM copies as they are, lower tiers' copies by chunk,
each checked against its checksum, shared by concurrent readers (a small cache of verified
chunks) and read ahead in the store's background nursery."""
from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Callable

import trio

from kvfs.errors import CorruptObject, NoSuchObject, TierUnavailable
from kvfs.store import checksum
from kvfs.store.ram import RamTier
from kvfs.store.tier import Tier

if TYPE_CHECKING:
    from kvfs.store.objects import Obj

log = logging.getLogger(__name__)

_CHUNK_CACHE = 48          # chunks of verified lower-tier bytes shared by readers
_READ_AHEAD = 4            # chunks fetched ahead of a reader of a lower tier (A/B on NVMe: 1: 0.55-0.60x, 2: 0.51-0.68x, 4: 0.65-0.84x O_DIRECT)


class Reads:
    """The object store's read path (kvfs/store/objects.py). ``ram``: the RAM tier;
    ``durable``: () -> the tiers below it, top first; ``counters``: per tier, the store's
    counters; ``telemetry``: kvfs.telemetry (missed deadlines), ``events`` its events;
    ``lose``: async (obj), the object's bytes are gone or wrong; ``deadline``: seconds a
    lower-tier read may take (0: none)."""

    def __init__(self, ram: RamTier, durable: Callable[[], list[Tier]], *, counters: dict, telemetry, events,
                 lose, deadline: float = 0.0):
        self.ram = ram
        self.durable = durable
        self.counters = counters
        self.telemetry = telemetry
        self.events = events
        self.lose = lose
        self.deadline = deadline
        self.chunks: collections.OrderedDict[tuple[int, int], bytes] = collections.OrderedDict()
        self.inflight: dict[tuple[int, int], trio.Event] = {}
        self.background: trio.Nursery | None = None    # the store's serve() nursery (read-ahead)

    def forget(self, oid: int) -> None:
        """Object ``oid``'s copies are freed: its cached chunks go."""
        for k in [k for k in self.chunks if k[0] == oid]:
            del self.chunks[k]

    async def read(self, obj: Obj, offset: int, length: int):
        if obj.corrupt:
            raise CorruptObject(f"object {obj.oid:x} failed its checksum")
        end = min(obj.size, offset + length)
        if offset >= end:
            return b""
        if self.ram.name in obj.place:
            mv = await self.ram.read(obj.oid, b"", offset, end - offset)
            self.counters[self.ram.name].bytes_read += len(mv)
            return mv
        tier = self.serving_tier(obj)
        cs = obj.chunk_size
        first, last = offset // cs, (end - 1) // cs
        # read ahead: the next chunk alongside this one, the one after once this is in
        # (a first read is not slowed by more than one competing fetch)
        self.read_ahead(obj, tier, last + 1)
        parts = await self.within_deadline(obj, tier, first, last)
        for i in range(last + 2, last + 1 + _READ_AHEAD):
            self.read_ahead(obj, tier, i)
        lo = offset - first * cs
        if len(parts) == 1:
            return memoryview(parts[0])[lo:lo + end - offset]
        return b"".join(parts)[lo:lo + end - offset]

    async def within_deadline(self, obj: Obj, tier: Tier, first: int, last: int) -> list[bytes]:
        """Chunks ``first..last`` of ``obj`` from ``tier``; a read that takes longer than
        ``deadline`` (the config's ``read_deadline``) (a stalled remote target, a hung disk) fails with TierUnavailable
        (EIO) and counts ``deadline_exceeded``. The remote tier's reads are cancelled (sockets);
        the NVMe tier's worker-thread reads are abandoned (the thread finishes when the disk
        answers, the reader does not wait for it)."""
        if not self.deadline:
            return [await self.chunk(obj, tier, i) for i in range(first, last + 1)]
        with trio.move_on_after(self.deadline):
            return [await self.chunk(obj, tier, i) for i in range(first, last + 1)]
        self.telemetry.deadline(tier.name)
        log.warning("read of %s (object %x) from %s passed its %.1f s deadline", obj.key, obj.oid,
                    tier.name, self.deadline)
        raise TierUnavailable(f"read of object {obj.oid:x} from {tier.name} passed its deadline")

    def serving_tier(self, obj: Obj) -> Tier:
        for t in self.durable():
            if t.name in obj.place:
                if not t.available:
                    raise TierUnavailable(f"object {obj.oid:x} lives on unavailable tier {t.name}")
                return t
        raise NoSuchObject(f"object {obj.oid:x} has no copy")

    def read_ahead(self, obj: Obj, tier: Tier, idx: int) -> None:
        """Fetch chunk ``idx`` in the background, in ``serve``'s nursery: a store that is not
        served (tools, in-process tests) or has shut down reads no further than asked."""
        key = (obj.oid, idx)
        if (self.background is not None and idx < len(obj.sums) and key not in self.chunks
                and key not in self.inflight):
            self.background.start_soon(self.prefetch, obj, tier, idx)

    async def prefetch(self, obj: Obj, tier: Tier, idx: int) -> None:
        if obj.dead or tier.name not in obj.place:     # gone before its turn came
            return
        try:
            await self.chunk(obj, tier, idx)
        except Exception:     # the reader that needs it will see the error
            pass

    async def chunk(self, obj: Obj, tier: Tier, idx: int) -> bytes:
        key = (obj.oid, idx)
        while True:
            data = self.chunks.get(key)
            if data is not None:
                self.chunks.move_to_end(key)
                return data
            ev = self.inflight.get(key)
            if ev is None:
                break
            await ev.wait()
            if key not in self.chunks:        # the leader failed: fail the same way
                return await self.fetch_chunk(obj, tier, idx)
        ev = self.inflight[key] = trio.Event()
        try:
            data = await self.fetch_chunk(obj, tier, idx)
            self.chunks[key] = data
            while len(self.chunks) > _CHUNK_CACHE:
                self.chunks.popitem(last=False)
            return data
        finally:
            del self.inflight[key]
            ev.set()

    async def fetch_chunk(self, obj: Obj, tier: Tier, idx: int) -> bytes:
        cs = obj.chunk_size
        want = min(cs, obj.size - idx * cs)
        c = self.counters[tier.name]
        loc = obj.place.get(tier.name)
        if loc is None:
            if obj.corrupt:
                raise CorruptObject(f"object {obj.oid:x} failed its checksum")
            raise NoSuchObject(f"object {obj.oid:x} has no copy on {tier.name}")
        try:
            data = bytes(await tier.read(obj.oid, loc, idx * cs, want))
        except TierUnavailable:
            c.errors += 1
            raise
        except NoSuchObject:
            data = b""
        if obj.corrupt:
            raise CorruptObject(f"object {obj.oid:x} failed its checksum")
        if (len(data) != want or checksum.digest(data) != obj.sums[idx]) and (
                obj.dead or tier.name not in obj.place):
            # dropped or moved off this tier while it was read (a read-ahead of a file just
            # deleted): nothing is corrupt, the copy is simply gone
            raise NoSuchObject(f"object {obj.oid:x} left tier {tier.name} while it was read")
        if len(data) != want or checksum.digest(data) != obj.sums[idx]:
            c.checksum_failures += 1
            log.error("checksum mismatch: object %x chunk %d on %s (%s)", obj.oid, idx, tier.name, obj.key)
            obj.corrupt = True
            self.events.emit("removed", obj, None)
            await self.lose(obj)
            raise CorruptObject(f"object {obj.oid:x} chunk {idx} failed its checksum on {tier.name}")
        c.bytes_read += want
        return data

    async def read_all(self, obj: Obj) -> memoryview:
        """The whole object, verified when it comes from a lower tier."""
        if obj.corrupt:
            raise CorruptObject(f"object {obj.oid:x} failed its checksum")
        if self.ram.name in obj.place:
            return await self.ram.read(obj.oid, b"", 0, obj.size)
        if not obj.size:
            return memoryview(b"")
        tier = self.serving_tier(obj)
        data = bytes(await tier.read(obj.oid, obj.place[tier.name], 0, obj.size))
        self.counters[tier.name].bytes_read += len(data)
        ok = len(data) == obj.size and await trio.to_thread.run_sync(
            lambda: checksum.chunk_sums(memoryview(data), obj.chunk_size) == obj.sums)
        if not ok:
            if obj.dead or tier.name not in obj.place:      # freed or moved while read
                raise NoSuchObject(f"object {obj.oid:x} left tier {tier.name} while it was read")
            self.counters[tier.name].checksum_failures += 1
            obj.corrupt = True
            self.events.emit("removed", obj, None)
            await self.lose(obj)
            raise CorruptObject(f"object {obj.oid:x} failed its checksum on {tier.name}")
        return memoryview(data)
