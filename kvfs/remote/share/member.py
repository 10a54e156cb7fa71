"""Joining a shared volume: node slot, epoch, region claim, and the node's publication log.

Slot: a node takes the slot that already holds its node id, or a free one; either way it
writes the slot with ``epoch + 1`` and a fresh nonce, flushes, waits ``settle`` and reads the
slot back: a joiner that lost the race for a free slot sees another nonce and tries again.

Region claim (two-phase ballot check; every claim row has one writer): read every row and
pick a region no row claims; write the claim into our own row; flush; read every row again.
If another row now claims that region, withdraw and retry. Of two nodes that claim the same
region at once, at least one reads the other's claim after writing its own (each writes
before it reads), so at most one keeps it; a row that does not verify (torn, damaged)
counts as a claim on every region.
"""
from __future__ import annotations

import logging
import random
import time

import trio

from kvfs.errors import ConfigError
from kvfs.remote.share import format as F
from kvfs.remote.volume import Volume

log = logging.getLogger(__name__)


async def read_units(vol: Volume, off: int, units: int, unit: int) -> memoryview:
    return await vol.read(off, units * unit)


async def write_unit(vol: Volume, off: int, data: bytes, unit: int) -> None:
    buf = vol.buffer(unit)
    buf[:unit] = data
    await vol.durable(await vol.write(off, memoryview(buf)[:unit]))


async def read_slots(vol: Volume, sb: F.Superblock2) -> list[F.NodeSlot | None]:
    raw = await read_units(vol, sb.slot_off(0), sb.max_nodes, sb.unit)
    return [F.NodeSlot.unpack(raw[i * sb.unit:(i + 1) * sb.unit]) for i in range(sb.max_nodes)]


async def read_claims(vol: Volume, sb: F.Superblock2) -> list[dict | None]:
    raw = await read_units(vol, sb.claim_off(0), sb.max_nodes, sb.unit)
    return [F.unpack_claims(raw[i * sb.unit:(i + 1) * sb.unit], sb.regions) for i in range(sb.max_nodes)]


async def join(vol: Volume, sb: F.Superblock2, node_id: str, hostnqn: str, *, settle: float = 0.2,
               tries: int = 8) -> tuple[int, F.NodeSlot]:
    """Take our slot (or a free one) with a bumped epoch; (slot index, slot)."""
    for _ in range(tries):
        slots = await read_slots(vol, sb)
        mine = [i for i, s in enumerate(slots) if s is not None and s.node_id == node_id]
        free = [i for i, s in enumerate(slots) if s is not None and s.free]
        if mine:
            i = mine[0]
        elif free:
            i = free[0]
        else:
            raise ConfigError(f"shared volume has no free node slot (max_nodes {sb.max_nodes})")
        old = slots[i]
        me = F.NodeSlot(node_id, hostnqn, old.epoch + 1, 0, old.log_seq if mine else 0,
                        random.getrandbits(63) or 1, time.time())
        await write_unit(vol, sb.slot_off(i), me.pack(sb.unit), sb.unit)
        await trio.sleep(settle)
        back = (await read_slots(vol, sb))[i]
        if back is not None and back.node_id == node_id and back.nonce == me.nonce:
            log.info("joined shared volume as node %r in slot %d, epoch %d", node_id, i, me.epoch)
            return i, me
        log.warning("slot %d was taken by another joiner; trying again", i)
        await trio.sleep(random.uniform(settle, 3 * settle))
    raise ConfigError("could not take a node slot on the shared volume (contention)")


async def claim_region(vol: Volume, sb: F.Superblock2, slot: int, epoch: int, *, tries: int = 8) -> int:
    """Our region: the one our row claims and still owns, else a free one won by the two-phase
    check; -1 when none is free. A claim of ours that another node's takeover superseded (our
    region was taken over while we were dead) is withdrawn from our row, never used again."""
    rows = await read_claims(vol, sb)
    own = dict(rows[slot] or {})
    standing = _standing(rows, slot, sb.regions)
    lost = sorted(r for r in own if r not in standing)
    if lost:
        log.warning("node slot %d: region(s) %s were taken over by another node; not writing them", slot, lost)
        for r in lost:
            del own[r]
        await write_unit(vol, sb.claim_off(slot), F.pack_claims(own, epoch, sb.regions, sb.unit), sb.unit)
    mine = [r for r, (_e, nonce) in own.items() if F.superseded_by(nonce) is None]
    if mine:
        log.info("node slot %d keeps region %d", slot, min(mine))
        return min(mine)
    for _ in range(tries):
        rows = await read_claims(vol, sb)
        taken = _taken(rows, slot, sb.regions)
        free = [r for r in range(sb.regions) if r not in taken and r not in own]
        if not free:
            log.warning("node slot %d: the shared volume has no free region", slot)
            return -1
        r = free[0]
        nonce = random.getrandbits(63) or 1
        await write_unit(vol, sb.claim_off(slot), F.pack_claims({**own, r: (epoch, nonce)}, epoch, sb.regions,
                                                                 sb.unit), sb.unit)
        rows = await read_claims(vol, sb)
        if r not in _taken(rows, slot, sb.regions):
            log.info("node slot %d claimed region %d (epoch %d)", slot, r, epoch)
            return r
        log.warning("region %d claimed by another node at the same time; withdrawing", r)
        await write_unit(vol, sb.claim_off(slot), F.pack_claims(own, epoch, sb.regions, sb.unit), sb.unit)
        await trio.sleep(random.uniform(0.05, 0.3))
    raise ConfigError("could not claim a region on the shared volume (contention)")


async def take_over(vol: Volume, sb: F.Superblock2, slot: int, epoch: int, victim: int, seen: F.NodeSlot,
                    region: int) -> bool:
    """Claim a dead node's region (two-phase, like a free one): write a takeover claim naming
    the victim's slot and the epoch seen there, then read every row and the victim's slot
    again. Withdraw if another live claim on the region appeared or the victim's slot moved
    (it heartbeated after all: it writes its heartbeat before it reads the claims, we write
    our claim before we read its slot, so one of the two sees the other)."""
    rows = await read_claims(vol, sb)
    own = dict(rows[slot] or {})
    claim = {**own, region: (epoch, F.takeover_nonce(victim, seen.epoch))}
    await write_unit(vol, sb.claim_off(slot), F.pack_claims(claim, epoch, sb.regions, sb.unit), sb.unit)
    rows = await read_claims(vol, sb)
    now = (await read_slots(vol, sb))[victim]
    moved = now is None or (now.node_id, now.epoch, now.nonce, now.heartbeat) != (
        seen.node_id, seen.epoch, seen.nonce, seen.heartbeat)
    if moved or region in _taken(rows, slot, sb.regions):
        log.warning("takeover of region %d from slot %d withdrawn (%s)", region, victim,
                    "the node heartbeated" if moved else "another node claimed it")
        await write_unit(vol, sb.claim_off(slot), F.pack_claims(own, epoch, sb.regions, sb.unit), sb.unit)
        return False
    log.warning("node slot %d took region %d over from dead slot %d (%r, epoch %d)", slot, region, victim,
                seen.node_id, seen.epoch)
    return True


def _standing(rows: list, slot: int, regions: int) -> set[int]:
    """Regions on which our (slot's) claim still stands."""
    rows = [r if i != slot else (r or {}) for i, r in enumerate(rows)]
    o = F.owners(rows, regions)
    if o is None:
        return set(rows[slot])          # unknown rows: keep ours, claim nothing new
    return {r for r, ss in o.items() if slot in ss}


def _taken(rows: list, slot: int, regions: int) -> set[int]:
    """Regions on which another node's claim stands (a row that does not verify claims all;
    our own row counts: our takeover claim supersedes the dead node's)."""
    rows = [r if i != slot else (r or {}) for i, r in enumerate(rows)]
    o = F.owners(rows, regions)
    if o is None:
        return set(range(regions))
    return {r for r, ss in o.items() if any(s != slot for s in ss)}


class Liveness:
    """Failure detector: a node is dead when its slot (heartbeat, epoch, nonce) has not changed
    for ``lease + grace`` seconds of the observer's own monotonic clock (no synchronized clocks).
    A slot that does not verify (torn by a concurrent write) counts as unchanged."""

    def __init__(self, lease: float, grace: float):
        self.lease, self.grace = lease, grace
        self.seen: dict[int, tuple] = {}
        self.since: dict[int, float] = {}
        self.slots: dict[int, F.NodeSlot] = {}
        self.last = float("-inf")        # clock at the last observation

    def observe(self, slots: list, now: float) -> None:
        """Feed one read of every slot. After a gap of more than lease/2 since the last read
        (this observer was frozen or could not reach the volume: nobody could be watched),
        every node starts a fresh lease + grace: silence we did not see is not death."""
        if now - self.last > self.lease / 2:
            for i in self.since:
                self.since[i] = now
        self.last = now
        for i, s in enumerate(slots):
            if s is None or s.free:
                continue
            key = (s.node_id, s.epoch, s.nonce, s.heartbeat)
            if self.seen.get(i) != key:
                self.seen[i], self.since[i] = key, now
                self.slots[i] = s

    def dead(self, now: float, exclude: int = -1) -> list[int]:
        return [i for i, t in self.since.items() if i != exclude and now - t > self.lease + self.grace]


class LogWriter:
    """Appends publication entries to this node's ring and flushes each append."""

    def __init__(self, vol: Volume, sb: F.Superblock2, slot: int):
        self.vol, self.sb, self.slot = vol, sb, slot
        self.per_unit = sb.unit // F.ENTRY
        self.next_seq = 1
        self._unit_buf: bytearray | None = None
        self._unit_no = -1
        self._lock = trio.Lock()
        self.guard = None           # raises when this node may not write now (fenced, partitioned)

    async def recover(self) -> None:
        """Find the end of our log: one past the highest whole entry (a torn one is overwritten)."""
        sb = self.sb
        raw = await read_units(self.vol, sb.log_off(self.slot), sb.log_units, sb.unit)
        best = 0
        for k in range(sb.log_entries):
            e = F.unpack_entry(raw, k * F.ENTRY)
            if e is not None and e.seq > best and (e.seq - 1) % sb.log_entries == k:
                best = e.seq
        self.next_seq = best + 1

    async def append(self, make) -> F.LogEntry:
        """``make(seq)`` builds the entry; it is written and flushed before this returns."""
        async with self._lock:
            e = make(self.next_seq)
            sb = self.sb
            pos = (e.seq - 1) % sb.log_entries
            unit_no = pos // self.per_unit
            if unit_no != self._unit_no:
                off = sb.log_off(self.slot) + unit_no * sb.unit
                self._unit_buf = bytearray(await self.vol.read(off, sb.unit))
                self._unit_no = unit_no
            k = (pos % self.per_unit) * F.ENTRY
            self._unit_buf[k:k + F.ENTRY] = e.pack()
            if self.guard is not None:
                self.guard()
            await write_unit(self.vol, sb.log_off(self.slot) + unit_no * sb.unit, bytes(self._unit_buf), sb.unit)
            self.next_seq += 1
            return e
