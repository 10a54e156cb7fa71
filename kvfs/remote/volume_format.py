"""On-volume formats: superblock, allocation table entries, object record headers.

Layout, in allocation units (``unit`` = max(4096, LBA size) bytes)::

    unit 0                  superblock
    units 1 .. table_end    allocation table: ``slots`` entries of 32 bytes
    data_start .. end       object records (1 MiB aligned start)

An object record is ``hdr_units`` units of header followed by the object's bytes
padded to a whole unit. The header is self-describing (magic, volume uuid, object
id, key, size, xxh3 checksum, chunk size and chunk checksums, generation) so the
index can be rebuilt from the volume. The allocation table is the commit point:
a record becomes live when its entry is written (after the record itself), and
is freed by zeroing the entry. The free-space map is the complement of the live
entries, rebuilt at open.
"""
from __future__ import annotations

import dataclasses
import struct
import uuid

from kvfs.remote.pdu import crc32c
from kvfs.store.tier import ObjectInfo

SB_MAGIC = b"KVFSVOL\0"
REC_MAGIC = b"KVFSREC\0"
VERSION = 1
ENTRY = struct.Struct("<QQQIHH")           # oid, start unit, size, units, hdr_units, check
ENTRY_SIZE = ENTRY.size
_SB = struct.Struct("<8sIIII16s64sdQQQQQQ")
_REC = struct.Struct("<8sHHHHQQQQII16sI")   # magic ver hdr_units keylen rsvd oid size checksum gen chunk nchunks vol crc
MAX_KEY = 1024


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass
class Superblock:
    unit: int
    lba_size: int
    volume_uuid: bytes
    owner: str
    created: float
    region: int              # bytes of the volume this store uses
    table_start: int         # units
    slots: int
    data_start: int          # units
    data_units: int
    version: int = VERSION

    @classmethod
    def plan(cls, *, region: int, lba_size: int, owner: str, created: float) -> "Superblock":
        unit = max(4096, lba_size)
        total = region // unit
        slots = max(1024, min(total // 64, 0xFFFFFFFF))
        table_units = round_up(slots * ENTRY_SIZE, unit) // unit
        align = max(1, (1 << 20) // unit)
        data_start = round_up(1 + table_units, align)
        if total - data_start < 16:
            raise ValueError(f"remote region of {region} bytes is too small for the layout")
        return cls(unit, lba_size, uuid.uuid4().bytes, owner, created, region, 1, slots, data_start,
                   total - data_start)

    @property
    def table_units(self) -> int:
        return round_up(self.slots * ENTRY_SIZE, self.unit) // self.unit

    def pack(self) -> bytes:
        o = self.owner.encode()[:64]
        body = _SB.pack(SB_MAGIC, self.version, self.unit, self.lba_size, 0, self.volume_uuid, o,
                        self.created, self.region, self.table_start, self.slots, self.data_start,
                        self.data_units, 0)
        body += struct.pack("<I", crc32c(body))
        return body + bytes(self.unit - len(body))

    @classmethod
    def unpack(cls, b: bytes) -> "Superblock | None":
        """None for a blank (all-zero) block; ValueError for anything that is not ours or is damaged."""
        if not any(b[:512]):
            return None
        if b[:8] != SB_MAGIC:
            raise ValueError("not a kvfs volume (no superblock magic)")
        ver = struct.unpack_from("<I", b, 8)[0]
        if ver == 2:
            raise ValueError("kvfs volume version 2 is not supported here: it is a shared volume "
                             "(mount it with share = true)")
        n = _SB.size
        if struct.unpack_from("<I", b, n)[0] != crc32c(b[:n]):
            raise ValueError("kvfs superblock checksum mismatch")
        (_m, ver, unit, lbs, _r, vid, owner, created, region, tstart, slots, dstart, dunits, _z) = _SB.unpack_from(b)
        if ver != VERSION:
            raise ValueError(f"kvfs volume version {ver} is not supported (want {VERSION})")
        return cls(unit, lbs, vid, owner.rstrip(b"\0").decode(errors="replace"), created, region, tstart,
                   slots, dstart, dunits, ver)


def pack_entry(oid: int, start: int, size: int, units: int, hdr_units: int) -> bytes:
    b = ENTRY.pack(oid, start, size, units, hdr_units, 0)
    return b[:30] + struct.pack("<H", (crc32c(b[:30]) & 0xFFFF) | 1)


def unpack_entry(b, off: int) -> tuple[int, int, int, int, int] | None:
    """(oid, start, size, units, hdr_units) of a live entry; None when free or damaged."""
    oid, start, size, units, hdr_units, check = ENTRY.unpack_from(b, off)
    if check == 0:
        return None
    if check != ((crc32c(bytes(b[off:off + 30])) & 0xFFFF) | 1):
        return None
    return oid, start, size, units, hdr_units


def header_units(info: ObjectInfo, unit: int) -> int:
    key = info.key.encode()[:MAX_KEY]
    return round_up(_REC.size + len(key) + 8 * len(info.chunk_sums), unit) // unit


def pack_header(info: ObjectInfo, volume_uuid: bytes, unit: int) -> bytes:
    key = info.key.encode()[:MAX_KEY]
    hu = header_units(info, unit)
    fixed = _REC.pack(REC_MAGIC, VERSION, hu, len(key), 0, info.oid, info.size, info.checksum,
                      info.generation, info.chunk_size, len(info.chunk_sums), volume_uuid, 0)
    body = bytearray(fixed + key + struct.pack(f"<{len(info.chunk_sums)}Q", *info.chunk_sums))
    struct.pack_into("<I", body, _REC.size - 4, crc32c(body))
    return bytes(body) + bytes(hu * unit - len(body))


def unpack_header(b, volume_uuid: bytes) -> ObjectInfo:
    """Parse and verify a record header; ValueError if it is not a valid record of this volume."""
    b = bytes(b)
    if len(b) < _REC.size or b[:8] != REC_MAGIC:
        raise ValueError("no record magic")
    (_m, ver, hu, klen, _r, oid, size, checksum, gen, chunk, nchunks, vid, crc) = _REC.unpack_from(b)
    if ver != VERSION or vid != volume_uuid:
        raise ValueError("record of another volume or version")
    used = _REC.size + klen + 8 * nchunks
    if used > len(b):
        raise ValueError("record header longer than read")
    body = bytearray(b[:used])
    struct.pack_into("<I", body, _REC.size - 4, 0)
    if crc32c(body) != crc:
        raise ValueError("record header checksum mismatch")
    key = b[_REC.size:_REC.size + klen].decode(errors="replace")
    sums = struct.unpack_from(f"<{nchunks}Q", b, _REC.size + klen)
    return ObjectInfo(oid=oid, size=size, checksum=checksum, chunk_size=chunk, chunk_sums=tuple(sums),
                      key=key, generation=gen)
