"""RemoteTier: the object store on a raw volume (NVMe/TCP namespace, block device or file).

See kvfs.remote.volume_format for the on-volume format. ``loc`` (kept by the store in its
LMDB index) packs the table slot, the record's start unit, its length in units and
its header length. The in-memory copy of the allocation table (read at open) is
the authority for which locs are live, so a stale loc reads as NoSuchObject.

Availability: while the volume is disconnected every put/read raises
TierUnavailable at once; deletes are remembered and applied (table entries
zeroed) when the connection returns, before their space is reused.
"""
from __future__ import annotations

import logging
import struct
import time
from typing import AsyncIterator, Callable

import trio

from kvfs.errors import ConfigError, NoSuchObject, TierFull, TierUnavailable
from kvfs.protocol import ALIGN
from kvfs.remote import volume_format as L
from kvfs.remote.alloc import ExtentAllocator, SlotAllocator
from kvfs.remote.volume import Volume
from kvfs.store.tier import ObjectInfo, Tier

log = logging.getLogger(__name__)

_LOC = struct.Struct("<BIQIH")      # version, slot, start unit, units, header units
_TABLE_READ = 8 << 20


class RemoteTier(Tier):
    name = "remote"
    volatile = False

    def __init__(self, volume: Volume, *, instance_id: str, size: str | int = "100%", format: bool = False,
                 describe: str = ""):
        super().__init__(0)
        self.vol = volume
        self.instance_id = instance_id
        self.size_spec = size
        self.format = format
        self.describe = describe or volume.describe
        self.sb: L.Superblock | None = None
        self.entries: dict[int, tuple[int, int, int, int, int]] = {}   # slot -> (oid, start, size, units, hdr)
        self._table: bytearray | None = None
        self._alloc: ExtentAllocator | None = None
        self._slots: SlotAllocator | None = None
        self._block_locks: dict[int, trio.Lock] = {}
        self._pending_deletes: dict[int, tuple[int, int]] = {}            # slot -> (start, units)
        self._loaded = False
        self.state = "closed"
        self.refused = ""

    # geometry --------------------------------------------------------------
    @property
    def unit(self) -> int:
        return self.sb.unit if self.sb else ALIGN

    def footprint(self, size: int) -> int:
        u = self.unit
        # upper bound for keys up to MAX_KEY and chunks of >= 1 MiB; put computes the exact size
        hdr = L.round_up(80 + L.MAX_KEY + 8 * max(1, -(-size // (1 << 20))), u)
        return hdr + L.round_up(max(size, 1), u)

    @property
    def available(self) -> bool:
        return self._loaded and self.vol.available and not self.refused

    @property
    def sized(self) -> bool:
        return self.sb is not None      # capacity comes from the superblock

    # open / load -----------------------------------------------------------
    async def open(self) -> None:
        try:
            await self.vol.open()
        except TierUnavailable as e:
            self.state = "disconnected"
            log.warning("remote tier unavailable at open: %s (will keep retrying)", e)
            return
        try:
            await self._load(first=True)
        except ConfigError:
            await self.vol.close()
            raise

    def _region(self) -> int:
        from kvfs.units import parse_size
        region = parse_size(self.size_spec, whole=self.vol.size)
        if region > self.vol.size:
            raise ConfigError(f"--remote-size {self.size_spec} exceeds the remote volume ({self.vol.size} bytes)")
        return region // ALIGN * ALIGN

    async def _load(self, *, first: bool) -> None:
        if self.sb is not None:
            await self.reload()
            return
        try:
            sb = await self._read_superblock()
        except ValueError as e:
            if not self.format:
                self._refuse(f"remote volume {self.describe}: {e}; pass --format-remote to format it")
            sb = None
        if sb is not None and sb.owner != self.instance_id and not self.format:
            self._refuse(f"remote volume {self.describe} belongs to kvfs instance {sb.owner!r} "
                         f"(this is {self.instance_id!r}); pass --format-remote to take it over")
        if sb is None or (self.format and first):
            sb = await self._format()
        self.sb = sb
        await self._read_table()
        self._loaded = True
        self.state = "connected"
        self.format = False
        log.info("remote tier on %s: %d objects, %d of %d bytes used", self.describe, self.objects,
                 self.used, self.capacity)

    async def _read_superblock(self) -> "L.Superblock | None":
        """The volume's superblock; None when blank, ValueError when not ours or damaged."""
        return L.Superblock.unpack(await self.vol.read(0, max(4096, self.vol.block_size)))

    async def reload(self) -> None:
        """After a reconnect: use the volume again only if it is the one we formatted.

        Runs before anything else can see the volume connected (no checkpoint between the
        connect and this call), and marks the tier unloaded first, so no read or write
        reaches a namespace that is blank, another instance's, or a different one of ours.
        A mismatch raises TierUnavailable: the volume drops the connection and keeps
        retrying with backoff, writing nothing, until the right volume is back.
        """
        self._loaded = False
        try:
            sb = await self._read_superblock()
        except ValueError as e:
            sb, why = None, str(e)
        else:
            why = f"volume {sb.volume_uuid.hex()} of instance {sb.owner!r}" if sb else "a blank volume"
        if sb is None or sb.volume_uuid != self.sb.volume_uuid:
            self.state = "changed"
            raise TierUnavailable(f"remote volume {self.describe} is not the one this tier uses "
                                  f"(expected volume {self.sb.volume_uuid.hex()}, found {why}); "
                                  f"leaving it alone")
        await self._apply_pending_deletes()
        self.state = "connected"
        self._loaded = True

    def _refuse(self, msg: str) -> None:
        self.refused = msg
        self.state = "refused"
        raise ConfigError(msg)

    async def _format(self) -> L.Superblock:
        region = self._region()
        try:
            sb = L.Superblock.plan(region=region, lba_size=self.vol.block_size, owner=self.instance_id,
                                   created=time.time())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        log.warning("formatting remote volume %s: %d bytes for instance %s", self.describe, region, self.instance_id)
        zero = self.vol.buffer(min(_TABLE_READ, sb.table_units * sb.unit))
        pos, end = sb.table_start * sb.unit, (sb.table_start + sb.table_units) * sb.unit
        while pos < end:
            n = min(len(zero), end - pos)
            await self.vol.write(pos, memoryview(zero)[:n])
            pos += n
        buf = self.vol.buffer(sb.unit)
        buf[:sb.unit] = sb.pack()
        gen = await self.vol.write(0, memoryview(buf)[:sb.unit])
        await self.vol.durable(gen)
        return sb

    async def _read_table(self) -> None:
        sb = self.sb
        size = sb.table_units * sb.unit
        table = bytearray(size)
        base = sb.table_start * sb.unit
        for pos in range(0, size, _TABLE_READ):
            n = min(_TABLE_READ, size - pos)
            table[pos:pos + n] = await self.vol.read(base + pos, n)
        entries, used = {}, []
        for slot in range(sb.slots):
            e = L.unpack_entry(table, slot * L.ENTRY_SIZE)
            if e is None:
                if any(table[slot * L.ENTRY_SIZE:(slot + 1) * L.ENTRY_SIZE]):
                    log.warning("remote table slot %d is damaged; ignoring it", slot)
                continue
            oid, start, osize, units, hdr = e
            if start < sb.data_start or start + units > sb.data_start + sb.data_units:
                log.warning("remote table slot %d points outside the data area; ignoring it", slot)
                continue
            entries[slot] = e
            used.append((start, units))
        try:
            alloc = ExtentAllocator.from_used(sb.data_start, sb.data_units, used)
        except ValueError as ex:
            raise ConfigError(f"remote volume {self.describe}: allocation table is inconsistent ({ex}); "
                              f"run fsck or pass --format-remote") from None
        self._table, self.entries, self._alloc = table, entries, alloc
        self._slots = SlotAllocator(sb.slots, set(entries))
        self.capacity = sb.data_units * sb.unit
        self.used = sum(e[3] for e in entries.values()) * sb.unit
        self.objects = len(entries)

    async def close(self) -> None:
        self._loaded = False
        self.state = "closed"
        await self.vol.close()

    async def serve(self) -> None:
        async def reconnected() -> None:
            try:
                await self._load(first=False)
            except ConfigError as e:          # a volume that could not be opened at mount time
                log.error("remote tier refused after reconnect: %s", e)
            except TierUnavailable as e:
                log.error("%s", e)
                raise
        await self.vol.serve(on_reconnect=reconnected)

    def current_state(self) -> str:
        if self.refused:
            return "refused"
        if not self.vol.available:
            if self.state == "closed":
                return "closed"
            return "changed" if self.state == "changed" else "disconnected"
        return "connected" if self._loaded else "connecting"

    # table writes ------------------------------------------------------------
    async def _write_entry(self, slot: int, entry: bytes) -> int:
        """Update one table entry on the volume; writes of one table unit are serialised."""
        sb = self.sb
        off = slot * L.ENTRY_SIZE
        self._table[off:off + L.ENTRY_SIZE] = entry
        blk = off // sb.unit
        lock = self._block_locks.setdefault(blk, trio.Lock())
        async with lock:
            buf = self.vol.buffer(sb.unit)
            buf[:sb.unit] = self._table[blk * sb.unit:(blk + 1) * sb.unit]
            return await self.vol.write((sb.table_start + blk) * sb.unit, memoryview(buf)[:sb.unit])

    async def _apply_pending_deletes(self) -> None:
        gen = 0
        for slot, (start, units) in list(self._pending_deletes.items()):
            gen = await self._write_entry(slot, bytes(L.ENTRY_SIZE))
            del self._pending_deletes[slot]
            self._alloc.free(start, units)
            self._slots.free(slot)
        if gen:
            await self.vol.durable(gen)

    def _need(self) -> None:
        if not self.available:
            raise TierUnavailable(f"remote tier {self.describe} is {self.current_state()}"
                                  + (f": {self.vol.last_error}" if self.vol.last_error else ""))

    # the Tier interface --------------------------------------------------------
    async def put(self, info: ObjectInfo, data: memoryview) -> bytes:
        self._need()
        sb = self.sb
        data = memoryview(data).cast("B")
        if len(data) != info.size:
            raise ValueError(f"put of object {info.oid}: {len(data)} bytes, info says {info.size}")
        hdr = L.pack_header(info, sb.volume_uuid, sb.unit)
        hu = len(hdr) // sb.unit
        units = hu + L.round_up(max(info.size, 1), sb.unit) // sb.unit
        start = self._alloc.alloc(units)
        if start is None:
            raise TierFull(f"remote tier: no room for {units * sb.unit} bytes")
        slot = self._slots.alloc()
        if slot is None:
            self._alloc.free(start, units)
            raise TierFull("remote tier: allocation table full")
        self.used += units * sb.unit
        self.objects += 1
        committed = False
        try:
            buf = self.vol.buffer(units * sb.unit)
            buf[:len(hdr)] = hdr
            buf[len(hdr):len(hdr) + info.size] = data
            await self.vol.write(start * sb.unit, memoryview(buf)[:units * sb.unit])
            entry = L.pack_entry(info.oid, start, info.size, units, hu)
            self.entries[slot] = (info.oid, start, info.size, units, hu)
            committed = True
            gen = await self._write_entry(slot, entry)
            await self.vol.durable(gen)
        except BaseException:
            if committed:        # the entry may be on the volume: free it through the delete path
                self.entries.pop(slot, None)
                self._pending_deletes[slot] = (start, units)
                self.used -= units * sb.unit
                self.objects -= 1
                if self.vol.available:
                    with trio.CancelScope(shield=True):
                        try:
                            await self._apply_pending_deletes()
                        except TierUnavailable:
                            pass
            else:
                self._alloc.free(start, units)
                self._slots.free(slot)
                self.used -= units * sb.unit
                self.objects -= 1
            raise
        return _LOC.pack(1, slot, start, units, hu)

    def entry(self, oid: int, loc: bytes) -> tuple[int, tuple[int, int, int, int, int]]:
        try:
            ver, slot, start, units, hu = _LOC.unpack(bytes(loc))
        except struct.error:
            raise NoSuchObject(f"remote: malformed location for object {oid}") from None
        e = self.entries.get(slot)
        if ver != 1 or e is None or e[0] != oid or e[1] != start or e[3] != units:
            raise NoSuchObject(f"remote: no object {oid} at slot {slot}")
        return slot, e

    async def read(self, oid: int, loc: bytes, offset: int, length: int) -> memoryview:
        self._need()
        _slot, (_oid, start, size, _units, hu) = self.entry(oid, loc)
        if offset < 0 or length < 0:
            raise ValueError("negative offset or length")
        length = max(0, min(length, size - offset))
        if length == 0:
            return memoryview(b"")
        bs = self.vol.block_size
        base = (start + hu) * self.sb.unit + offset
        lo = base // bs * bs
        hi = L.round_up(base + length, bs)
        view = await self.vol.read(lo, hi - lo)
        return view[base - lo:base - lo + length]

    async def delete(self, oid: int, loc: bytes) -> None:
        try:
            slot, (_oid, start, _size, units, _hu) = self.entry(oid, loc)
        except NoSuchObject:
            return
        if self.sb is None:
            return
        del self.entries[slot]
        self.used -= units * self.sb.unit
        self.objects -= 1
        self._pending_deletes[slot] = (start, units)
        if self.available:
            await self._apply_pending_deletes()

    async def scan(self) -> AsyncIterator[tuple[int, bytes, int]]:
        for slot, (oid, start, size, units, hu) in sorted(self.entries.items()):
            yield oid, _LOC.pack(1, slot, start, units, hu), size
            await trio.lowlevel.checkpoint()

    async def scan_records(self, progress: Callable[[int, int], None] | None = None
                           ) -> AsyncIterator[tuple[ObjectInfo, bytes]]:
        """Read and verify every live record header; yield (ObjectInfo, loc) for the index rebuild.

        Records whose header does not verify (torn by a crash before their put returned)
        are logged and skipped. ``progress(done, total)`` is called as headers are read.
        """
        self._need()
        items = sorted(self.entries.items())
        total, done = len(items), 0
        for i in range(0, total, 64):
            batch = items[i:i + 64]
            results: list = [None] * len(batch)

            async def one(k: int, slot: int, e: tuple) -> None:
                oid, start, _size, _units, hu = e
                raw = await self.vol.read(start * self.sb.unit, hu * self.sb.unit)
                try:
                    info = L.unpack_header(raw, self.sb.volume_uuid)
                except ValueError as ex:
                    log.warning("remote record at slot %d (object %d): %s; skipped", slot, oid, ex)
                    return
                if info.oid != oid:
                    log.warning("remote record at slot %d holds object %d, table says %d; skipped",
                                slot, info.oid, oid)
                    return
                results[k] = (info, _LOC.pack(1, slot, start, e[3], hu))

            async with trio.open_nursery() as n:
                for k, (slot, e) in enumerate(batch):
                    n.start_soon(one, k, slot, e)
            for r in results:
                done += 1
                if progress:
                    progress(done, total)
                if r is not None:
                    yield r

    def status(self) -> dict:
        st = {"state": self.current_state(), "pending_deletes": len(self._pending_deletes)}
        if self.refused:
            st["refused"] = self.refused
        if self.sb:
            st["volume_uuid"] = self.sb.volume_uuid.hex()
        st.update(self.vol.status())
        return st
