"""Volume format 2 (a volume shared by several kvfs nodes): on-volume structures.

Layout in units (``unit`` = max(4096, LBA size) bytes; see docs/scale-out.md)::

    unit 0                        superblock v2
    1 .. max_nodes                node slots (one unit each, written by the slot's holder)
    then max_nodes units          claim rows (one unit each, written by the row's node)
    then max_nodes * log_units    publication logs (ring of 512-byte entries per node)
    data_start ..                 ``regions`` data regions of ``region_units`` units, each
                                  holding a format-1 volume (its own superblock, table, records)

Every structure carries a CRC32C and has exactly one writer, so the protocol needs nothing
of the target beyond whole-unit reads and writes and Flush.
"""
from __future__ import annotations

import dataclasses
import struct
import uuid

from kvfs.remote.pdu import crc32c

SB2_MAGIC = b"KVFSVOL\0"
VERSION = 2
_SB2 = struct.Struct("<8sIII16sIIIQQQQQd")   # magic ver unit lba uuid max_nodes log_units regions
#                                             region_units slots claims logs data created
_SLOT = struct.Struct("<I64s224sQQQQd")       # crc node_id hostnqn epoch heartbeat log_seq nonce updated
_CLAIM_HDR = struct.Struct("<IIQ")           # crc, count, epoch of the row's node at its last write
_CLAIM = struct.Struct("<QQ")                # per region: epoch claimed with (0 = no claim), nonce
ENTRY = 512
_ENT = struct.Struct("<IIQQBBHQIHHQQQQI16sQ")  # magic crc seq epoch op rsvd region start units hu
#                                                 klen oid gen size checksum chunk vol mtime
ENT_MAGIC = 0x4B56504C                        # "KVPL"
OP_PUT, OP_FREE = 1, 2
MAX_KEY = ENTRY - _ENT.size


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass
class Superblock2:
    unit: int
    lba_size: int
    volume_uuid: bytes
    max_nodes: int
    log_units: int
    regions: int
    region_units: int
    slots_start: int
    claims_start: int
    logs_start: int
    data_start: int
    created: float = 0.0
    version: int = VERSION

    @classmethod
    def plan(cls, *, size: int, lba_size: int, max_nodes: int, regions: int = 0, log_units: int = 256,
             created: float = 0.0) -> "Superblock2":
        unit = max(4096, lba_size)
        if not 1 <= max_nodes <= 255:
            raise ValueError(f"max_nodes must be 1..255, not {max_nodes}")
        regions = regions or max_nodes
        if not max_nodes <= regions <= (unit - _CLAIM_HDR.size) // _CLAIM.size:
            raise ValueError(f"regions must be from max_nodes to {(unit - _CLAIM_HDR.size) // _CLAIM.size}")
        total = size // unit
        slots, claims = 1, 1 + max_nodes
        logs = claims + max_nodes
        align = max(1, (1 << 20) // unit)
        data = round_up(logs + max_nodes * log_units, align)
        region_units = (total - data) // regions // align * align
        if region_units < 2 * align:
            raise ValueError(f"a volume of {size} bytes is too small for {regions} regions")
        return cls(unit, lba_size, uuid.uuid4().bytes, max_nodes, log_units, regions, region_units,
                   slots, claims, logs, data, created)

    def pack(self) -> bytes:
        body = _SB2.pack(SB2_MAGIC, self.version, self.unit, self.lba_size, self.volume_uuid, self.max_nodes,
                         self.log_units, self.regions, self.region_units, self.slots_start,
                         self.claims_start, self.logs_start, self.data_start, self.created)
        body += struct.pack("<I", crc32c(body))
        return body + bytes(self.unit - len(body))

    @classmethod
    def unpack(cls, b) -> "Superblock2":
        b = bytes(b)
        n = _SB2.size
        if b[:8] != SB2_MAGIC or struct.unpack_from("<I", b, 8)[0] != VERSION:
            raise ValueError("not a format-2 (shared) kvfs volume")
        if struct.unpack_from("<I", b, n)[0] != crc32c(b[:n]):
            raise ValueError("format-2 superblock checksum mismatch")
        (_m, ver, unit, lbs, vid, mn, lu, rg, ru, ss, cs, ls, ds, created) = _SB2.unpack_from(b)
        return cls(unit, lbs, vid, mn, lu, rg, ru, ss, cs, ls, ds, created, ver)

    # byte offsets
    def slot_off(self, slot: int) -> int:
        return (self.slots_start + slot) * self.unit

    def claim_off(self, slot: int) -> int:
        return (self.claims_start + slot) * self.unit

    def log_off(self, slot: int) -> int:
        return (self.logs_start + slot * self.log_units) * self.unit

    def region_off(self, region: int) -> int:
        return (self.data_start + region * self.region_units) * self.unit

    @property
    def region_bytes(self) -> int:
        return self.region_units * self.unit

    @property
    def log_entries(self) -> int:
        return self.log_units * (self.unit // ENTRY)


def version_of(b) -> int | None:
    """The format version in a unit-0 block: None when blank, 0 when not a kvfs volume."""
    b = bytes(b[:512])
    if not any(b):
        return None
    if b[:8] != SB2_MAGIC:
        return 0
    return struct.unpack_from("<I", b, 8)[0]


@dataclasses.dataclass
class NodeSlot:
    node_id: str = ""
    hostnqn: str = ""
    epoch: int = 0
    heartbeat: int = 0
    log_seq: int = 0         # hint: the next sequence number of this node's log
    nonce: int = 0           # random per join: tells two joiners of one free slot apart
    updated: float = 0.0

    def pack(self, unit: int) -> bytes:
        body = bytearray(_SLOT.pack(0, self.node_id.encode()[:64], self.hostnqn.encode()[:224], self.epoch,
                                    self.heartbeat, self.log_seq, self.nonce, self.updated))
        struct.pack_into("<I", body, 0, crc32c(body[4:]))
        return bytes(body) + bytes(unit - len(body))

    @classmethod
    def unpack(cls, b) -> "NodeSlot | None":
        """The slot; an empty NodeSlot when blank; None when torn or damaged (unknown)."""
        b = bytes(b[:_SLOT.size])
        if not any(b):
            return cls()
        (crc, nid, nqn, epoch, hb, seq, nonce, upd) = _SLOT.unpack(b)
        if crc != crc32c(b[4:]):
            return None
        return cls(nid.rstrip(b"\0").decode(errors="replace"), nqn.rstrip(b"\0").decode(errors="replace"),
                   epoch, hb, seq, nonce, upd)

    @property
    def free(self) -> bool:
        return not self.node_id


def pack_claims(claims: dict[int, tuple[int, int]], epoch: int, regions: int, unit: int) -> bytes:
    """A node's claim row: region -> (epoch it was claimed with, nonce)."""
    body = bytearray(_CLAIM_HDR.size + regions * _CLAIM.size)
    for r, (ep, nonce) in claims.items():
        _CLAIM.pack_into(body, _CLAIM_HDR.size + r * _CLAIM.size, ep, nonce)
    _CLAIM_HDR.pack_into(body, 0, 0, regions, epoch)
    struct.pack_into("<I", body, 0, crc32c(body[4:]))
    return bytes(body) + bytes(unit - len(body))


TAKEOVER = 1 << 63           # a claim's nonce with this bit names the claim it supersedes


def takeover_nonce(victim_slot: int, victim_epoch: int) -> int:
    """The nonce of a takeover claim: it supersedes ``victim_slot``'s claims made at an epoch
    up to ``victim_epoch`` (the epoch the claimant saw in the dead node's slot)."""
    return TAKEOVER | (victim_slot & 0xFFFF) << 47 | (victim_epoch & ((1 << 47) - 1))


def superseded_by(nonce: int) -> tuple[int, int] | None:
    """(victim slot, victim epoch) of a takeover claim's nonce; None for an ordinary claim."""
    if not nonce & TAKEOVER:
        return None
    return (nonce >> 47) & 0xFFFF, nonce & ((1 << 47) - 1)


def owners(rows: list, regions: int) -> dict[int, list[int]] | None:
    """region -> the slots whose claim on it stands (not superseded by a takeover); None when a
    row does not verify (unknown: the caller must assume it claims everything)."""
    if any(r is None for r in rows):
        return None
    beaten = set()                      # (slot, region) whose claim a takeover superseded
    for row in rows:
        for r, (_ep, nonce) in row.items():
            v = superseded_by(nonce)
            if v is not None:
                vs, vep = v
                if vs < len(rows) and r in rows[vs] and rows[vs][r][0] <= vep:
                    beaten.add((vs, r))
    out: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        for r in row:
            if (i, r) not in beaten and r < regions:
                out.setdefault(r, []).append(i)
    return out


def unpack_claims(b, regions: int) -> dict[int, tuple[int, int]] | None:
    """region -> (epoch, nonce) of a row; {} when blank; None when torn or damaged."""
    b = bytes(b[:_CLAIM_HDR.size + regions * _CLAIM.size])
    if not any(b):
        return {}
    crc, count, _epoch = _CLAIM_HDR.unpack_from(b)
    if count != regions or crc != crc32c(b[4:]):
        return None
    out = {}
    for r in range(regions):
        ep, nonce = _CLAIM.unpack_from(b, _CLAIM_HDR.size + r * _CLAIM.size)
        if ep:
            out[r] = (ep, nonce)
    return out


@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One publication: a record put in (or freed from) the node's region."""
    seq: int
    epoch: int
    op: int
    region: int
    start: int = 0
    units: int = 0
    hdr_units: int = 0
    oid: int = 0
    generation: int = 0
    size: int = 0
    checksum: int = 0
    chunk_size: int = 0
    region_uuid: bytes = bytes(16)
    mtime_ns: int = 0
    key: str = ""

    def pack(self) -> bytes:
        key = self.key.encode("utf-8", "surrogateescape")
        if len(key) > MAX_KEY:
            raise ValueError(f"name of {len(key)} bytes is too long to publish (max {MAX_KEY})")
        body = bytearray(_ENT.pack(ENT_MAGIC, 0, self.seq, self.epoch, self.op, 0, self.region, self.start,
                                   self.units, self.hdr_units, len(key), self.oid, self.generation, self.size,
                                   self.checksum, self.chunk_size, self.region_uuid, self.mtime_ns) + key)
        struct.pack_into("<I", body, 4, crc32c(bytes(body[8:])))
        return bytes(body) + bytes(ENTRY - len(body))


def unpack_entry(b, off: int = 0) -> LogEntry | None:
    """The entry at ``off``; None when blank, torn or damaged."""
    (magic, crc, seq, epoch, op, _r, region, start, units, hu, klen, oid, gen, size, cks, chunk, vid,
     mtime) = _ENT.unpack_from(b, off)
    if magic != ENT_MAGIC or klen > MAX_KEY or op not in (OP_PUT, OP_FREE):
        return None
    if crc != crc32c(bytes(b[off + 8:off + _ENT.size + klen])):
        return None
    key = bytes(b[off + _ENT.size:off + _ENT.size + klen]).decode("utf-8", "surrogateescape")
    return LogEntry(seq, epoch, op, region, start, units, hu, oid, gen, size, cks, chunk, vid, mtime, key)


FOREIGN_LOC = struct.Struct("<BHHQIHQQ16sQ")  # 2, owner slot, region, start, units, hdr units, oid, gen, uuid,
#                                              xxh3 of the whole block
_FOREIGN_LOC_V1 = struct.Struct("<BHHQIHQQ16s")   # before takeover regions were writable: no xxh3


def pack_foreign_loc(slot: int, e: LogEntry) -> bytes:
    return FOREIGN_LOC.pack(2, slot, e.region, e.start, e.units, e.hdr_units, e.oid, e.generation, e.region_uuid,
                            e.checksum)


def unpack_foreign_loc(loc) -> tuple | None:
    """(slot, region, start, units, hdr units, oid, generation, region uuid, xxh3 or None)."""
    loc = bytes(loc)
    if not loc or loc[0] != 2:
        return None
    if len(loc) == FOREIGN_LOC.size:
        return FOREIGN_LOC.unpack(loc)[1:]
    if len(loc) == _FOREIGN_LOC_V1.size:
        return _FOREIGN_LOC_V1.unpack(loc)[1:] + (None,)
    return None
