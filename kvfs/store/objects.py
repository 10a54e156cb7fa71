"""Sealed objects: placement across tiers, demotion, promotion, eviction; their verified reads
are a member (reads.py).

Placement is inclusive: promotion copies an object up and keeps its lower copy,
so demoting it again is free and a restart still finds it. The RAM tier is
volatile; an object whose only copy is in RAM does not survive a crash (its
name disappears with it) but is written down on a clean unmount.

The namespace is not this module's business: it learns that an object lost its
bytes (eviction, checksum failure) through the ``on_lost`` callback, which
removes the name in the same index transaction as the object record.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

import trio

from kvfs.errors import TierUnavailable
from kvfs.store import checksum
from kvfs.store.fair import Shares, TierLRU
from kvfs.store.index import Index, Txn
from kvfs.store.moves import Mover
from kvfs.store.objtable import ObjTable
from kvfs.store.policy import Policy
from kvfs.store.prefix import PrefixRule
from kvfs.store.reads import Reads
from kvfs.store.ram import RamTier
from kvfs.store.staging import FileSource, Staging, read_private, sum_file
from kvfs.store.records import ObjectRecord
from kvfs.store.tally import Tally
from kvfs.store.tier import ObjectInfo, Tier
from kvfs.telemetry import Telemetry, namespace_of

log = logging.getLogger(__name__)

INLINE_HASH = 256 << 10     # objects up to this size are hashed on the trio thread at seal


@dataclasses.dataclass(eq=False, slots=True)
class Obj:
    oid: int
    size: int
    checksum: int
    chunk_size: int
    sums: tuple[int, ...]
    place: dict[str, bytes]
    ino: int
    key: str = ""
    gen: int = 0
    hits: int = 0
    atime: float = 0.0
    pinned: bool = False
    refs: int = 0
    dead: bool = False         # no longer in the index; free its copies at refs == 0
    corrupt: bool = False      # dropped because a copy failed its checksum (reads: EIO)
    busy: bool = False         # being moved between tiers
    win_start: float = 0.0
    win_count: int = 0
    held_in: str | None = None  # dropped while held: the namespace its bytes are charged to

    def info(self) -> ObjectInfo:
        return ObjectInfo(self.oid, self.size, self.checksum, self.chunk_size, self.sums, self.key, self.gen)

    def record(self) -> ObjectRecord:
        return ObjectRecord(self.size, self.checksum, self.chunk_size, checksum.pack_sums(self.sums),
                            dict(self.place), self.ino, self.key, self.gen, self.hits, self.atime)

    @classmethod
    def from_record(cls, oid: int, r: ObjectRecord) -> "Obj":
        return cls(oid, r.size, r.checksum, r.chunk_size, checksum.unpack_sums(r.sums), dict(r.place), r.ino,
                   r.key, r.gen, r.hits, r.atime)


class TierCounters:
    __slots__ = ("hits", "misses", "bytes_read", "bytes_written", "demotions", "promotions",
                 "evictions", "checksum_failures", "errors")

    def __init__(self):
        for s in self.__slots__:
            setattr(self, s, 0)

    def as_dict(self) -> dict:
        return {s: getattr(self, s) for s in self.__slots__}


class ObjectStore:
    """The object table, reads and the background work; what to place where is ``policy``'s
    (policy.py), moving bytes between tiers ``mover``'s (moves.py).

    ``tiers``: top first; ``ram``: the volatile RAM tier among them, where writes are sealed
    and promotions go. ``prefix``: the prefix rule of eviction (prefix.py), which the policy
    applies and the namespace keeps counting.
    """

    def __init__(self, index: Index, tiers: list[Tier], *, ram: RamTier, prefix: PrefixRule, chunk_size: int,
                 high: float, low: float, promote_hits: int, promote_window: float,
                 admit_after: dict[str, int] | None = None, read_deadline: float = 0.0):
        assert ram in tiers
        self.index = index
        self.tiers = tiers
        self.ram = ram
        self.chunk_size = chunk_size
        # running totals and the RAM-only set, kept in the index's commits (tally.py)
        self.tally = Tally(index, {t.name: t.footprint for t in tiers if not t.volatile})
        # oid -> Obj, built from its record on first use after a clean mount (objtable.py)
        self.objs = ObjTable(index, self._materialize)
        # per tier, its objects by namespace in LRU order (fair victim choice, fair.py)
        self.shares = Shares(lambda: sum(t.capacity for t in self.tiers))
        self.lru: dict[str, TierLRU] = {t.name: TierLRU(self.shares) for t in tiers}
        self.counters = {t.name: TierCounters() for t in tiers}
        self.telemetry = Telemetry()     # histograms, namespaces, events (kvfs.telemetry)
        # bytes of dropped objects a reader still holds (open, leased), by namespace: they
        # stay in their tiers until released, and count against the namespace's quota
        self.held: dict[str, int] = {}
        self.events = self.telemetry.events
        # verified reads, by chunk from the tiers below RAM (reads.py)
        self.reads = Reads(ram, self.durable, counters=self.counters, telemetry=self.telemetry, events=self.events,
                           lose=self.lose, deadline=read_deadline)
        self.policy = Policy(tiers, ram, self.objs, fair=self.lru, prefix=prefix, telemetry=self.telemetry,
                             high=high, low=low, promote_hits=promote_hits, promote_window=promote_window,
                             admit_after=admit_after)
        self.mover = Mover(tiers, ram, index, self.objs, lru=self.lru, counters=self.counters,
                           events=self.events, policy=self.policy, read_all=self.reads.read_all, lose=self.lose,
                           rekey=self.rekey, wait_loaded=self.wait_loaded,
                           dropping=lambda oid: self.on_copy_dropped(oid))
        # set by the namespace: drop the object's name and record in this txn
        self.on_lost: Callable[[Txn, Obj], None] = lambda txn, obj: None
        self.key_of: Callable[[Obj], str] = lambda obj: obj.key    # current path, for records
        self.on_materialize: Callable[[Obj], None] = lambda obj: None   # set by the namespace
        # a copy of the object is about to be freed (its file unlinked): whatever still holds
        # that file open past its readers (an idle passthrough registration) lets it go first,
        # so the space the tier's budget gives back is free (set by kvfs.build.build_ops)
        self.on_copy_dropped: Callable[[int], None] = lambda oid: None
        self._loaded = trio.Event()        # set once the table scan is done (or not needed)
        self._loaded.set()
        self._scanning = False
        self._scan_ended = trio.Event()
        self._dirty: set[int] = set()
        self._kick = trio.Event()
        self._promote_send, self._promote_recv = trio.open_memory_channel(64)
        self._moving = 0           # background relieve/promote passes running
        # promotions sent and not yet started: a send hands the object straight to a waiting
        # receiver (the channel's buffer stays empty) before that task runs, so the buffer
        # alone let ``settled`` say True with a promotion about to start
        self._promote_queued = 0

    # ---- loading ------------------------------------------------------------
    def load(self) -> list[Obj]:
        """Read the whole object table (after a crash: recovery needs every record);
        return objects that lost every durable copy."""
        durable = {t.name for t in self.tiers if not t.volatile}
        lost = []
        for oid, rec in self.index.iter_objects():
            obj = Obj.from_record(oid, rec)
            obj.place = {k: v for k, v in obj.place.items() if k in durable}
            if obj.size and not obj.place:
                lost.append(obj)
                continue
            self.adopt(obj)
        for t in self.durable():
            t.used = sum(t.footprint(o.size) for o in self.objs.values() if t.name in o.place)
            t.objects = sum(1 for o in self.objs.values() if t.name in o.place)
        return lost

    def load_clean(self, marker: dict) -> None:
        """After a clean unmount: take the totals from its marker and decode nothing; objects
        are built on first use and the LRU order is scanned in the background (``serve``)."""
        for t in self.durable():
            used = marker["tiers"].get(t.name)
            if used is not None:
                t.used, t.objects = used
        self.telemetry.restore(marker["namespaces"])
        self.objs.count = marker["objects"]
        self._scan_tiers = {t.name for t in self.durable() if marker["tiers"].get(t.name, [0, 1])[1]}
        self._scan_kv = bool(marker.get("kv_parents", 1))
        self.objs.begin_scan()
        self._loaded = trio.Event()

    def _materialize(self, oid: int, rec: ObjectRecord) -> Obj | None:
        """The Obj of an object record not built yet (durable placement only)."""
        obj = Obj.from_record(oid, rec)
        obj.place = {k: v for k, v in obj.place.items() if not self._tier(k).volatile}
        if obj.size and not obj.place:
            log.error("object %x (%s) has no durable copy", oid, obj.key)
            return None
        self.on_materialize(obj)
        return obj

    @property
    def table_loaded(self) -> bool:
        """The LRU order and KV child counts cover every object (eviction may choose)."""
        return self._loaded.is_set()

    async def wait_loaded(self) -> None:
        """Wait for the background table scan; run it here when no ``serve`` runs it (or
        the one that ran was cancelled)."""
        while not self._loaded.is_set():
            if self._scanning:
                await self._scan_ended.wait()
            else:
                await self._scan()

    async def _scan(self) -> None:
        self._scanning, self._scan_ended = True, trio.Event()
        try:
            await self.objs.scan(self._scan_tiers, self.lru, self.policy.prefix.add if self._scan_kv else None)
        finally:
            self._scanning = False
            self._scan_ended.set()
        log.info("object table scanned: %d objects, %d built", len(self.objs), dict.__len__(self.objs))
        self._loaded.set()
        self.kick()

    def adopt(self, obj: Obj) -> None:
        dict.__setitem__(self.objs, obj.oid, obj)
        self.objs.count += 1
        self.telemetry.adopt(obj.size, obj.key)
        for name in obj.place:
            self.lru[name].add(obj)

    # ---- creating and dropping ----------------------------------------------
    async def create(self, ino: int, staging: Staging, key: str, gen: int, summary=None, oid=None, mapping=None) -> Obj:
        """Seal a write buffer into a new object placed on the highest tier with room.

        ``summary``: ``checksum.summarize`` of the buffer, when the daemon took it while
        filling the buffer (kvfs.store.commit) and nothing could change the buffer since.
        The caller records it in the index (``obj.record()``) in the same
        transaction that points the inode at it. ``oid``: the id the buffer was made for
        (RamTier.object_file); ``mapping``: its read-only mapping (unused: closed when dropped).
        """
        await staging.back()        # every page of its tmpfs file allocated, or spilled
        size = staging.size
        if summary is not None and not staging.spilled:
            await trio.lowlevel.checkpoint_if_cancelled()
            obj = self._new_obj(ino, size, summary, key, gen, oid)
        else:
            obj = await self._summed(ino, staging, key, gen, summary, oid)
        if size and not staging.spilled:
            obj.place[self.ram.name] = self.ram.adopt(obj.info(), staging, mapping)
            self.counters[self.ram.name].bytes_written += size
        self.adopt(obj)
        self.kick()
        return obj

    def _new_obj(self, ino: int, size: int, summary: tuple, key: str, gen: int, oid: int | None = None) -> Obj:
        oid = self.index.new_id(b"oid") if oid is None else oid
        return Obj(oid, size, summary[0], self.chunk_size, summary[1], {}, ino, key, gen, atime=time.time())

    async def _summed(self, ino: int, staging: Staging, key: str, gen: int, summary: tuple | None, oid=None) -> Obj:
        """The new object of ``staging``, checksummed here unless ``summary`` (a spilled buffer
        is also put on the tier it spilled to, from the same view)."""
        size = staging.size
        if size and staging.spilled:
            return await self._summed_spilled(ino, staging, key, gen, summary, oid)
        with staging.mapped() as view:
            if summary is not None:
                whole, sums = summary
            elif size <= INLINE_HASH and not staging.spilled:    # a thread hop costs more than this hash
                # a cancellation point only: a full checkpoint (a pass of trio's scheduler and
                # an epoll_wait) cost 14-23 us here, more than hashing 32 KiB
                await trio.lowlevel.checkpoint_if_cancelled()
                whole, sums = checksum.summarize(view, self.chunk_size)
            else:
                whole, sums = await trio.to_thread.run_sync(checksum.summarize, view, self.chunk_size)
            return self._new_obj(ino, size, (whole, sums), key, gen, oid)

    async def _summed_spilled(self, ino: int, staging: Staging, key: str, gen: int, summary: tuple | None,
                              oid=None) -> Obj:
        """:meth:`_summed` of a buffer spilled to NVMe: read with ``pread`` into private memory
        (summed on the way unless ``summary``), never mapped (a mapped file's I/O error is a
        SIGBUS), then put on the first tier below RAM with room for it."""
        size = staging.size
        fd = os.dup(staging.fd)         # its own: the buffer may be discarded while threads read
        try:
            if summary is None:
                summary = await trio.to_thread.run_sync(sum_file, fd, size, self.chunk_size)
            obj = self._new_obj(ino, size, summary, key, gen, oid)
            tier = await self.mover.room_below(self.tiers.index(self.ram), size)
            if tier.puts_from_slices:   # read piece by piece as the tier writes: bounded memory
                obj.place[tier.name] = await self.mover.put(self.tiers.index(tier), obj, FileSource(fd, size))
            else:                       # a tier that takes the bytes whole (remote: one buffer)
                buf = await trio.to_thread.run_sync(read_private, fd, size)
                view = memoryview(buf)[:size]
                try:
                    obj.place[tier.name] = await self.mover.put(self.tiers.index(tier), obj, view)
                finally:
                    view.release()
                    buf.close()
            self.counters[tier.name].bytes_written += size
        finally:
            os.close(fd)
        return obj

    def drop(self, txn: Txn, obj: Obj) -> None:
        """Remove the object's record in ``txn``; call ``release_space`` after commit."""
        txn.del_object(obj.oid)
        self._forget(obj)

    def _forget(self, obj: Obj) -> None:
        obj.dead = True
        if self.objs.forget(obj.oid):
            self.telemetry.forget(obj.size, obj.key)
            if obj.refs > 0 and obj.held_in is None and obj.place:
                ns = obj.held_in = namespace_of(obj.key)
                self.held[ns] = self.held.get(ns, 0) + obj.size
        self._dirty.discard(obj.oid)
        for name in obj.place:
            self.lru[name].discard(obj)

    async def release_space(self, obj: Obj) -> None:
        """Free the copies of a dropped object unless a reader still holds it."""
        if not obj.dead or obj.refs > 0:
            return
        if obj.held_in is not None:         # no longer held: its charge goes with its copies
            left = self.held.get(obj.held_in, 0) - obj.size
            if left > 0:
                self.held[obj.held_in] = left
            else:
                self.held.pop(obj.held_in, None)
            obj.held_in = None
        if any(not self._tier(name).volatile for name in obj.place):
            self.index.commit()         # the drop is in LMDB before a durable copy goes
        place, obj.place = obj.place, {}
        if place:
            self.on_copy_dropped(obj.oid)
        for name, loc in place.items():
            tier = self._tier(name)
            try:
                await tier.delete(obj.oid, loc)
            except TierUnavailable:
                log.warning("could not free object %x on unavailable tier %s", obj.oid, name)
        self.reads.forget(obj.oid)

    def rekey(self, obj: Obj) -> None:
        """Refresh ``obj.key`` (its current path) before it is written to a tier."""
        key = self.key_of(obj)
        if key != obj.key:
            if obj.dead:
                obj.key = key
                return
            self.telemetry.rekey(obj.size, obj.key, key)
            moved = namespace_of(key) != namespace_of(obj.key)
            for name in obj.place if moved else ():     # renamed into another namespace
                self.lru[name].discard(obj)
            obj.key = key
            for name in obj.place if moved else ():
                self.lru[name].add(obj)

    def _tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    def durable(self) -> list[Tier]:
        """The tiers below RAM, top first."""
        return [t for t in self.tiers if t is not self.ram]

    # ---- reading ------------------------------------------------------------
    def top_tier(self, obj: Obj) -> str:
        for t in self.tiers:
            if t.name in obj.place:
                return t.name
        return next((t.name for t in self.durable()), self.ram.name)

    def note_open(self, obj: Obj) -> None:
        """Count a hit on the serving tier, misses above it, and maybe promote."""
        now = time.time()
        obj.hits += 1
        obj.atime = now
        self.telemetry.hit(obj.key)
        self._dirty.add(obj.oid)
        for t in self.tiers:
            if t.name in obj.place:
                self.counters[t.name].hits += 1
                break
            self.counters[t.name].misses += 1
        for name in obj.place:
            self.lru[name].touch(obj)
        if self.policy.wants_promotion(obj, now):
            try:
                self._promote_send.send_nowait(obj)
                self._promote_queued += 1
            except trio.WouldBlock:
                pass

    async def lose(self, obj: Obj) -> None:
        """The object's bytes are gone or wrong: drop it and its name."""
        if obj.dead:
            return
        with self.index.write() as txn:
            self.on_lost(txn, obj)
            self.drop(txn, obj)
        await self.release_space(obj)

    # ---- background ---------------------------------------------------------
    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The store's background work: pressure relief, promotion, stats and read-ahead,
        all in one nursery (cancelled at shutdown, so none of it runs after)."""
        try:
            async with trio.open_nursery() as nursery:
                self.reads.background = nursery
                nursery.start_soon(self._pressure_loop)
                nursery.start_soon(self._promote_loop)
                nursery.start_soon(self._stats_loop)
                if not self._loaded.is_set() and not self._scanning:
                    nursery.start_soon(self._scan)
                task_status.started()
        finally:
            self.reads.background = None

    def kick(self) -> None:
        """Wake the pressure loop when a tier is above its high watermark."""
        if self.policy.pressed():
            self._kick.set()

    async def _pressure_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            self._moving += 1
            try:
                await self.mover.relieve()
            finally:
                self._moving -= 1

    async def _promote_loop(self) -> None:
        async for obj in self._promote_recv:
            self._promote_queued -= 1
            self._moving += 1
            try:
                await self.mover.promote(obj)
            finally:
                self._moving -= 1

    def queues(self) -> dict[str, int]:
        """Background work now: promotions queued, relieve/promote passes running (metrics)."""
        return {"promotion": self._promote_send.statistics().current_buffer_used, "moving": self._moving}

    def settled(self) -> bool:
        """No demotion, eviction or promotion is running or queued (for tests and tools)."""
        return (not self._moving and not self._kick.is_set() and self._loaded.is_set()
                and self._promote_queued == 0)

    async def _stats_loop(self) -> None:
        while True:
            await trio.sleep(5)
            self.flush_stats()
            self.index.commit()
            await trio.to_thread.run_sync(self.index.sync)

    def flush_stats(self) -> None:
        dirty, self._dirty = self._dirty, set()
        if not dirty:
            return
        with self.index.write() as txn:
            for oid in dirty:
                obj = self.objs.get(oid)
                rec = txn.get_object(oid) if obj is not None else None
                if rec is not None:
                    txn.put_object(oid, obj.record(), old=rec)     # the totals need not read it again

    def statistics(self) -> dict:
        """Per tier: its size, the store's counters and the tier's own status. A tier that
        counts errors of its own (the remote volume's transport: failed connects and I/O)
        reports ``errors`` as the sum of both, with ``store_errors`` (the store's count: failed
        reads and writes) and ``transport_errors`` (the tier's) beside it."""
        out = {}
        for t in self.tiers:
            d = {"capacity": t.capacity, "used": t.used, "objects": t.objects, "available": t.available}
            d.update(self.counters[t.name].as_dict())
            status = t.status()
            own = status.pop("errors", None)
            d.update(status)
            if own is not None:
                d["store_errors"], d["transport_errors"] = d["errors"], own
                d["errors"] += own
            out[t.name] = d
        out[self.ram.name]["staged"] = self.ram.staged
        return out
