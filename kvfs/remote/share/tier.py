"""SharedRemoteTier: the remote tier on a format-2 (shared) volume.

At open the node joins (slot, epoch), claims one data region and runs the ordinary
format-1 object store (RemoteTier) inside it through a RegionVolume. Each committed put and
each free is then published to the node's log (Publisher role); ``serve`` also tails the
other nodes' logs every ``poll`` seconds into ``view`` (Tailer role) and rewrites the node's
slot with a heartbeat. Reads of another node's block (a "foreign" location, version 2) go to
that node's region by location and are accepted only if the record header still names the
published object (region uuid, oid, generation); the store then checks every chunk's xxh3.
"""
from __future__ import annotations

import logging
import time

import trio

from kvfs.errors import ConfigError, NoSuchObject, TierFull, TierUnavailable
from kvfs.remote import volume_format as L
from kvfs.remote.share import format as F
from kvfs.remote.share.member import (LogWriter, Liveness, claim_region, join, read_claims, take_over,
                                      write_unit)
from kvfs.remote.share import held as H
from kvfs.remote.share.region import RegionVolume
from kvfs.remote.share.view import Published, SharedView, Tailer
from kvfs.remote.tier import _LOC, RemoteTier
from kvfs.remote.volume import Volume
from kvfs.store.tier import ObjectInfo

log = logging.getLogger(__name__)


class SharedRemoteTier(RemoteTier):
    sweep_by_location = True        # Store.sweep_orphans: a stray record of a known object is freed
    def __init__(self, volume: Volume, *, instance_id: str, node_id: str = "", hostnqn: str = "",
                 format: bool = False, max_nodes: int = 8, poll: float = 0.5, lease: float = 10.0,
                 settle: float = 0.2, log_units: int = 256, describe: str = "", grace: float | None = None,
                 takeover: bool = True):
        super().__init__(volume, instance_id=instance_id, size="100%", format=False,
                         describe=describe or volume.describe)
        self.parent = volume
        self.node_id = node_id or instance_id
        self.hostnqn = hostnqn
        self.format_shared = format
        self.max_nodes = max_nodes
        self.poll = poll
        self.lease = lease
        self.grace = lease / 2 if grace is None else grace
        url = getattr(volume, "url", None)
        self.io_timeout = float(getattr(url, "timeout", 5.0) or 5.0)
        self.takeover = takeover
        self.clock = time.monotonic        # the failure detector's clock (a test may replace it)
        self.last_ack = 0.0                # clock at our last acknowledged heartbeat (or join)
        self.partitioned = False           # our heartbeat failed for lease/2: we write nothing
        self.partitions = 0
        self.liveness = Liveness(lease, self.grace)
        self.takeovers = 0
        self.settle = settle
        self.log_units = log_units
        self.sb2: F.Superblock2 | None = None
        self.slot = -1
        self.node: F.NodeSlot | None = None
        self.region = -1
        self.view = SharedView()
        # the regions taken over from dead nodes (held.py); the clock is read through self,
        # which a test may replace after this
        self.regions = H.HeldRegions(volume, owner=instance_id, guard=self._may_write,
                                     clock=lambda: self.clock(), publish=self._publish, count=self._count,
                                     view=self.view)
        self.tailer: Tailer | None = None
        self.logw: LogWriter | None = None
        self.published = 0
        self.publish_errors = 0
        self.foreign_misses = 0
        self.tail_errors = 0
        self.fenced = ""                # why this node may no longer write (empty: it may)
        self.on_dropped = None          # async (list of (path, Published)): set by SharedNames
        self.tail_status: dict | None = None   # the tailer's status as of the last whole poll
        self.names = None               # the SharedNames of the mount (status only)

    @property
    def capacity(self) -> int:
        """Our region's data area plus that of every held region we may write in now (before
        ``writable_at`` a held region adds nothing: the store must not count on its room)."""
        return self._own_capacity + self.regions.capacity()

    @capacity.setter
    def capacity(self, v: int) -> None:
        self._own_capacity = v

    def _count(self, nbytes: int, objects: int) -> None:
        """Add a held region's put (or, negative, free) to our totals."""
        self.used += nbytes
        self.objects += objects

    # ---- open: format 2, join, claim ------------------------------------------
    async def open(self) -> None:
        try:
            await self.parent.open()
        except TierUnavailable as e:
            raise ConfigError(f"shared remote volume {self.describe} is unreachable: {e}") from None
        try:
            await self._join()
        except BaseException:
            await self.parent.close()
            raise

    async def _join(self) -> None:
        unit = max(4096, self.parent.block_size)
        raw = await self.parent.read(0, unit)
        ver = F.version_of(raw)
        if ver == F.VERSION and not self.format_shared:
            try:
                sb2 = F.Superblock2.unpack(raw)
            except ValueError as e:
                self._refuse(f"remote volume {self.describe}: {e}")
        elif ver is None or self.format_shared:
            sb2 = await self._format_shared()
        else:
            what = "a single-node (format 1) kvfs volume" if ver == 1 else "not a kvfs volume"
            self._refuse(f"remote volume {self.describe} is {what}; pass --format-remote to format it "
                         f"as a shared volume")
        self.sb2 = sb2
        self.slot, self.node = await join(self.parent, sb2, self.node_id, self.hostnqn, settle=self.settle)
        before = await _own_claims(self.parent, sb2, self.slot)
        self.region = await claim_region(self.parent, sb2, self.slot, self.node.epoch)
        self.last_ack = self.clock()
        self.logw = LogWriter(self.parent, sb2, self.slot)
        self.logw.guard = self._may_write
        await self.logw.recover()
        if self.region < 0:                 # our region was taken over and none is free
            self.fenced = "read-only: no free region on the shared volume"
            self.state = "fenced"
        else:
            self.vol = RegionVolume(self.parent, sb2.region_off(self.region), sb2.region_bytes)
            self.vol.guard = self._may_write
            self.format = self.region not in before     # a newly claimed region is formatted (format 1)
            await self._load(first=True)
        for r, (_ep, nonce) in (await read_claims(self.parent, sb2))[self.slot].items():
            v = F.superseded_by(nonce)
            if v is not None:               # a region we took over before a restart: still held
                self.regions.held[r] = {"from_slot": v[0], "from_epoch": v[1], "writable_at": self.clock()}
                await self.regions.open(r, self.sb2)
        self.tailer = Tailer(self.parent, sb2, self.slot, self.view)
        await self.tailer.poll()
        self.liveness.observe(self.tailer.slots, self.clock())
        log.info("shared volume %s: node %r slot %d epoch %d region %d, log at %d, %d published by others",
                 self.describe, self.node_id, self.slot, self.node.epoch, self.region,
                 self.logw.next_seq, len(self.view))

    async def _load(self, *, first: bool) -> None:
        if self.region < 0:
            return                          # read-only: no region of ours to load (also after a reconnect)
        await super()._load(first=first)
        await self.regions.reload()         # after a reconnect: same region volumes, deletes applied

    async def _format_shared(self) -> F.Superblock2:
        try:
            sb2 = F.Superblock2.plan(size=self.parent.size, lba_size=self.parent.block_size,
                                     max_nodes=self.max_nodes, log_units=self.log_units,
                                     created=time.time())
        except ValueError as e:
            raise ConfigError(f"remote volume {self.describe}: {e}") from None
        log.warning("formatting remote volume %s as shared (format 2): %d nodes, %d regions of %d bytes",
                    self.describe, sb2.max_nodes, sb2.regions, sb2.region_bytes)
        zero = self.parent.buffer(1 << 20)
        pos, end = sb2.unit, sb2.data_start * sb2.unit
        while pos < end:
            n = min(len(zero), end - pos)
            await self.parent.write(pos, memoryview(zero)[:n])
            pos += n
        for r in range(sb2.regions):        # region superblocks: blank, so a claim formats them
            await self.parent.write(sb2.region_off(r), memoryview(zero)[:sb2.unit])
        await write_unit(self.parent, 0, sb2.pack(), sb2.unit)
        self.format_shared = False
        return sb2

    # ---- fencing ----------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return super().available and not self.fenced and not self.partitioned

    def current_state(self) -> str:
        if self.fenced:
            return "fenced"
        return "partitioned" if self.partitioned else super().current_state()

    def _may_write(self) -> None:
        """Called right before every write to our region or log (not the heartbeat): refuse
        when fenced, or when our last acknowledged heartbeat is older than lease/2 (we may be
        partitioned or were frozen: others may think us dead soon; see docs/scale-out.md)."""
        if self.fenced:
            raise TierUnavailable(f"remote tier {self.describe} is fenced: {self.fenced}")
        if self.partitioned or self.clock() - self.last_ack > self.lease / 2:
            self._set_partitioned()
            raise TierUnavailable(f"remote tier {self.describe} is partitioned: no heartbeat acknowledged "
                                  f"for more than {self.lease / 2:.1f} s; not writing")

    def _set_partitioned(self) -> None:
        if not self.partitioned:
            self.partitioned = True
            self.partitions += 1
            log.error("shared volume: no heartbeat acknowledged for lease/2 (%.1f s); this node stops "
                      "writing to the volume until one is and its region is still its own", self.lease / 2)

    async def _check_fence(self) -> None:
        """Before every put and free: is our slot still ours (node id, nonce), and does our
        claim on our region still stand (no takeover by another node superseded it)?

        Another process that joined with our node id (a restart while this one was frozen)
        has bumped the epoch and written a new nonce: this one is fenced and stops writing
        for good (its region now belongs to the new holder). The window left is the time
        between this read and the write that follows it; only target-side fencing closes it.
        """
        if self.fenced:
            raise TierUnavailable(f"remote tier {self.describe} is fenced: {self.fenced}")
        sb2 = self.sb2
        raw = await self.parent.read(sb2.slot_off(0), 2 * sb2.max_nodes * sb2.unit)   # slots, then claim rows
        s = F.NodeSlot.unpack(raw[self.slot * sb2.unit:(self.slot + 1) * sb2.unit])
        rows = [F.unpack_claims(raw[(sb2.max_nodes + i) * sb2.unit:(sb2.max_nodes + i + 1) * sb2.unit],
                                sb2.regions) for i in range(sb2.max_nodes)]
        rows[self.slot] = rows[self.slot] or {}
        o = F.owners(rows, sb2.regions)
        if s is None or s.node_id != self.node_id or s.nonce != self.node.nonce:
            self.fenced = (f"slot {self.slot} now holds node {s.node_id!r} epoch {s.epoch}" if s is not None
                           else f"slot {self.slot} does not verify")
        elif o is not None and self.region >= 0 and self.slot not in o.get(self.region, []):
            who = o.get(self.region, [])
            self.fenced = f"region {self.region} was taken over by node slot(s) {who}"
        elif o is not None and any(self.slot not in o.get(r, []) for r in self.regions.tiers):
            lost = [r for r in self.regions.tiers if self.slot not in o.get(r, [])]
            self.fenced = f"held region(s) {lost} were taken over by another node"
        if self.fenced:
            self.state = "fenced"
            log.error("shared volume: this node (epoch %d) is fenced (%s); it writes nothing more",
                      self.node.epoch, self.fenced)
            raise TierUnavailable(f"remote tier {self.describe} is fenced: {self.fenced}")

    # ---- publishing ---------------------------------------------------------------
    async def _publish(self, op: int, oid: int, loc: bytes, info: ObjectInfo | None, region: int = -1,
                       region_uuid: bytes | None = None) -> None:
        """Append a put or free of the record at ``loc`` (a region tier's loc) of our own
        region, or of held region ``region`` (whose format-1 volume uuid is ``region_uuid``)."""
        _v, _slot, start, units, hu = _LOC.unpack(loc)
        if region < 0:
            region, region_uuid = self.region, self.sb.volume_uuid
        key = info.key if info else ""
        if info is not None and len(key.encode("utf-8", "surrogateescape")) > F.MAX_KEY:
            log.warning("not publishing %s: name longer than %d bytes", key, F.MAX_KEY)
            return

        def make(seq: int) -> F.LogEntry:
            return F.LogEntry(seq, self.node.epoch, op, region, start, units, hu, oid,
                              info.generation if info else 0, info.size if info else 0,
                              info.checksum if info else 0, info.chunk_size if info else 0,
                              region_uuid, time.time_ns(), key)
        try:
            await self.logw.append(make)
            self.published += 1
        except TierUnavailable as e:
            self.publish_errors += 1
            log.warning("could not publish %s of object %x: %s", "put" if op == F.OP_PUT else "free", oid, e)

    async def put(self, info: ObjectInfo, data: memoryview) -> bytes:
        self._need()
        await self._check_fence()
        try:
            loc = await super().put(info, data)
        except TierFull:
            if not self.regions.tiers:
                raise
            return await self.regions.put(info, data)
        await self._publish(F.OP_PUT, info.oid, loc, info)
        return loc

    async def republish(self, info: ObjectInfo, loc: bytes) -> None:
        """Publish one of our records again under its current name (after a rename)."""
        if F.unpack_foreign_loc(loc) is not None or not self.available:
            return
        if H.is_held_loc(loc):
            region, rloc = H.unpack_held_loc(loc)
            h = self.regions.tiers.get(region)
            try:
                if h is None:
                    return
                h.entry(info.oid, rloc)
            except NoSuchObject:
                return
            await self._publish(F.OP_PUT, info.oid, rloc, info, region, h.sb.volume_uuid)
            return
        try:
            self.entry(info.oid, loc)
        except NoSuchObject:
            return
        await self._publish(F.OP_PUT, info.oid, bytes(loc), info)

    async def delete(self, oid: int, loc: bytes) -> None:
        if F.unpack_foreign_loc(loc) is not None:
            return                          # another node's block: its owner decides
        if H.is_held_loc(loc):
            rec = None if self.fenced else self.regions.record(oid, loc)   # fenced: not ours to free any more
            if rec is not None:
                if self.available:
                    await self._check_fence()
                await self.regions.free(oid, *rec)
            return
        try:
            self.entry(oid, loc)
        except NoSuchObject:
            return
        if self.fenced:
            return                          # not ours to free any more
        if self.available:
            await self._check_fence()
        await self._publish(F.OP_FREE, oid, bytes(loc), None)   # tailers drop it before the space goes
        _v, _slot, start, _units, _hu = _LOC.unpack(bytes(loc))
        try:        # no header, no block: a reader by location now misses even before reuse
            await write_unit(self.vol, start * self.sb.unit, bytes(self.sb.unit), self.sb.unit)
        except TierUnavailable as e:
            log.warning("could not clear the record header of object %x: %s", oid, e)
        await super().delete(oid, loc)

    # ---- reading other nodes' blocks ------------------------------------------------
    async def foreign_header(self, p: Published, *, check_size: bool = True,
                             checksum: int | None = None) -> ObjectInfo | None:
        """The record header of a published block if it still names that block (region uuid,
        oid, generation, and the whole block's xxh3: after a takeover two nodes' oids meet in
        one region, so oid and generation alone could name another node's new record), else None."""
        e = p.entry
        sb2 = self.sb2
        if self.sb2 is None or not 0 <= e.region < sb2.regions or (e.start + e.units) > sb2.region_units:
            return None
        self._need_parent()
        raw = await self.parent.read(sb2.region_off(e.region) + e.start * sb2.unit, e.hdr_units * sb2.unit)
        try:
            info = L.unpack_header(raw, e.region_uuid)
        except ValueError:
            info = None
        if check_size:
            checksum = e.checksum
        if info is None or info.oid != e.oid or info.generation != e.generation or (
                check_size and info.size != e.size) or (checksum is not None and info.checksum != checksum):
            self.foreign_misses += 1
            return None
        return info

    def _need_parent(self) -> None:
        if not self.parent.available:
            raise TierUnavailable(f"remote tier {self.describe} is {self.current_state()}")

    async def read(self, oid: int, loc: bytes, offset: int, length: int) -> memoryview:
        if H.is_held_loc(loc):
            region, rloc = H.unpack_held_loc(loc)
            h = self.regions.tiers.get(region)
            if h is None:
                raise NoSuchObject(f"remote: region {region} is not held by this node")
            return await h.read(oid, rloc, offset, length)
        f = F.unpack_foreign_loc(loc)
        if f is None:
            return await super().read(oid, loc, offset, length)
        slot, region, start, units, hu, foid, gen, vid, cks = f
        e = F.LogEntry(0, 0, F.OP_PUT, region, start, units, hu, foid, gen, 0, 0, 0, vid)
        info = await self.foreign_header(Published(slot, "", e), check_size=False, checksum=cks)
        if info is None or offset < 0 or length < 0:
            raise NoSuchObject(f"remote: block {foid:x} of node slot {slot} is no longer there")
        length = max(0, min(length, info.size - offset))
        if length == 0:
            return memoryview(b"")
        sb2 = self.sb2
        bs = self.parent.block_size
        base = sb2.region_off(region) + (start + hu) * sb2.unit + offset
        lo, hi = base // bs * bs, L.round_up(base + length, bs)
        view = await self.parent.read(lo, hi - lo)
        return view[base - lo:base - lo + length]

    # ---- background: heartbeat and tailing -------------------------------------------
    async def serve(self) -> None:
        async with trio.open_nursery() as n:
            n.start_soon(super().serve)
            n.start_soon(self._tail_loop)
            n.start_soon(self._heartbeat_loop)

    async def _tail_loop(self) -> None:
        while True:
            await trio.sleep(self.poll)
            if not self.parent.available or self.tailer is None:
                continue
            await self.tail_once()

    async def tail_once(self) -> None:
        """One poll of the other nodes' logs, the failure detector, and a takeover if one is due."""
        try:
            await self.tailer.poll()
            self.liveness.observe(self.tailer.slots, self.clock())
            if self.takeover and self.available:
                await self._take_over_dead()
        except TierUnavailable as e:
            log.debug("tailing the shared volume: %s", e)
        except Exception:       # noqa: BLE001 - a bad log must not take the mount down
            self.tail_errors += 1
            log.exception("tailing the shared volume failed; next try in %.1f s", self.poll)
        gone, self.view.dropped = self.view.dropped, []
        if gone and self.on_dropped is not None:
            try:
                await self.on_dropped(gone)
            except Exception:   # noqa: BLE001 - the names stay; their reads still verify
                self.tail_errors += 1
                log.exception("dropping %d names freed by their owners failed", len(gone))
        # what stats report as tailed: only once this poll's frees are applied (the names
        # dropped, the kernel told), never the tailer's position while they are under way
        self.tail_status = self.tailer.status() if self.tailer else {}

    async def _take_over_dead(self) -> None:
        """Claim the regions of nodes the failure detector finds dead (one region per poll)."""
        sb2 = self.sb2
        rows = await read_claims(self.parent, sb2)
        o = F.owners(rows, sb2.regions)
        if o is None:
            return
        for victim in self.liveness.dead(self.clock(), exclude=self.slot):
            seen = self.liveness.slots[victim]
            for r, holders in sorted(o.items()):
                if victim not in holders or r in self.regions.held:
                    continue
                self._may_write()
                if not await take_over(self.parent, sb2, self.slot, self.node.epoch, victim, seen, r):
                    return
                await self._replay(victim, seen, r)
                return

    async def _replay(self, victim: int, seen: F.NodeSlot, region: int) -> None:
        """After winning a dead node's region: read its whole log (its view survives us) and
        republish its live blocks in our log, so every node sees them as ours. We write in the
        region itself no sooner than lease + grace + the initiator timeout from now."""
        self.tailer.next_seq.pop(victim, None)
        await self.tailer.poll()                     # a rescan of the victim's ring, and the others
        self.takeovers += 1
        self.regions.held[region] = {"from_slot": victim, "from_node": seen.node_id, "from_epoch": seen.epoch,
                                     "writable_at": self.clock() + self.lease + self.grace + self.io_timeout}
        n = 0
        for path, p in sorted(self.view.by_path.items()):
            e = p.entry
            if p.slot != victim or e.region != region or e.op != F.OP_PUT:
                continue
            await self.logw.append(lambda seq, e=e: F.LogEntry(
                seq, self.node.epoch, F.OP_PUT, e.region, e.start, e.units, e.hdr_units, e.oid, e.generation,
                e.size, e.checksum, e.chunk_size, e.region_uuid, e.mtime_ns, e.key))
            n += 1
        self.published += n
        log.warning("took region %d over from node %r (slot %d, epoch %d): %d published blocks kept",
                    region, seen.node_id, victim, seen.epoch, n)
        await self.regions.open(region, self.sb2)

    async def _heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(self.lease / 4)
            if self.fenced:
                return
            if self.parent.available:
                await self.heartbeat()
            if self.clock() - self.last_ack > self.lease / 2:
                self._set_partitioned()

    async def heartbeat(self) -> None:
        """Write our slot with heartbeat + 1. After a partition (or a freeze) the node writes
        again only if, read after this heartbeat landed, its region is still its own."""
        try:
            await self._check_fence()
        except TierUnavailable:
            return
        self.node.heartbeat += 1
        self.node.log_seq = self.logw.next_seq
        self.node.updated = time.time()
        try:
            await write_unit(self.parent, self.sb2.slot_off(self.slot), self.node.pack(self.sb2.unit),
                             self.sb2.unit)
            if self.partitioned:
                await self._check_fence()        # after the heartbeat: a claimant sees it, or we see the claim
                self.partitioned = False
                log.warning("shared volume: heartbeat acknowledged again; this node writes again")
            self.last_ack = self.clock()
        except TierUnavailable as e:
            log.debug("heartbeat: %s", e)

    def status(self) -> dict:
        st = super().status()
        if self.sb2 is not None:
            st["share"] = {"node_id": self.node_id, "slot": self.slot, "epoch": self.node.epoch,
                           "region": self.region, "max_nodes": self.sb2.max_nodes,
                           "volume_uuid": self.sb2.volume_uuid.hex(), "published": self.published,
                           "log_next_seq": self.logw.next_seq if self.logw else 0,
                           "publish_errors": self.publish_errors, "view": len(self.view),
                           "foreign_misses": self.foreign_misses, "tail_errors": self.tail_errors,
                           "fenced": self.fenced, "partitioned": self.partitioned,
                           "partitions": self.partitions, "lease": self.lease, "grace": self.grace,
                           "takeovers": self.takeovers,
                           "held": self.regions.status(),
                           "tail": self.tail_status if self.tail_status is not None
                           else (self.tailer.status() if self.tailer else {}),
                           **(self.names.status() if self.names is not None else {})}
        return st

    # ---- our records: counted and listed with those in the held regions ----------------
    def recount(self, locs) -> None:
        """After the store loaded (``locs``: every loc the index holds on this tier): mark our
        own records in held regions, and count only our records as used (not the dead nodes'
        inherited ones, nor other nodes' blocks the index adopted)."""
        self.regions.mark_own(locs)
        held_bytes, held_objects = self.regions.own_totals()
        self.used = (sum(e[3] for e in self.entries.values()) * self.sb.unit if self.sb else 0) + held_bytes
        self.objects = len(self.entries) + held_objects

    async def scan(self):
        async for item in super().scan():
            yield item
        async for item in self.regions.scan():
            yield item


async def _own_claims(vol: Volume, sb2: F.Superblock2, slot: int) -> set[int]:
    return set((await read_claims(vol, sb2))[slot] or {})
