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
    """Our region: the one our row already claims, else a free one won by the two-phase check."""
    rows = await read_claims(vol, sb)
    own = rows[slot] or {}
    if own:
        r = min(own)
        log.info("node slot %d keeps region %d", slot, r)
        return r
    for _ in range(tries):
        rows = await read_claims(vol, sb)
        taken = _taken(rows, slot, sb.regions)
        free = [r for r in range(sb.regions) if r not in taken]
        if not free:
            raise ConfigError("shared volume has no free region")
        r = free[0]
        nonce = random.getrandbits(63) or 1
        await write_unit(vol, sb.claim_off(slot), F.pack_claims({r: (epoch, nonce)}, epoch, sb.regions, sb.unit),
                         sb.unit)
        rows = await read_claims(vol, sb)
        if r not in _taken(rows, slot, sb.regions):
            log.info("node slot %d claimed region %d (epoch %d)", slot, r, epoch)
            return r
        log.warning("region %d claimed by another node at the same time; withdrawing", r)
        await write_unit(vol, sb.claim_off(slot), F.pack_claims({}, epoch, sb.regions, sb.unit), sb.unit)
        await trio.sleep(random.uniform(0.05, 0.3))
    raise ConfigError("could not claim a region on the shared volume (contention)")


def _taken(rows: list, slot: int, regions: int) -> set[int]:
    taken: set[int] = set()
    for i, row in enumerate(rows):
        if i == slot:
            continue
        if row is None:                 # unknown: assume it claims everything
            return set(range(regions))
        taken.update(row)
    return taken


class LogWriter:
    """Appends publication entries to this node's ring and flushes each append."""

    def __init__(self, vol: Volume, sb: F.Superblock2, slot: int):
        self.vol, self.sb, self.slot = vol, sb, slot
        self.per_unit = sb.unit // F.ENTRY
        self.next_seq = 1
        self._unit_buf: bytearray | None = None
        self._unit_no = -1
        self._lock = trio.Lock()

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
            await write_unit(self.vol, sb.log_off(self.slot) + unit_no * sb.unit, bytes(self._unit_buf), sb.unit)
            self.next_seq += 1
            return e
