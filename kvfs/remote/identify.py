"""Parsing of Identify Controller / Identify Namespace data and the CAP/VS registers."""
from __future__ import annotations

import dataclasses
import struct

from kvfs.remote.errors import ProtocolError


def _text(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("ascii", "replace").strip()


@dataclasses.dataclass(frozen=True)
class ControllerId:
    vid: int
    ssvid: int
    serial: str
    model: str
    firmware: str
    mdts: int            # 0: no limit; else 2**mdts units of the minimum page size
    cntlid: int
    version: int
    kas: int             # keep-alive granularity, 100 ms units
    sqes: int
    cqes: int
    maxcmd: int
    nn: int              # number of namespaces
    sgls: int
    subnqn: str
    ioccsz: int          # I/O command capsule size, 16-byte units
    iorcsz: int
    icdoff: int
    msdbd: int
    oncs: int = 0        # optional NVM commands (bit 0 Compare, 5 Reservations)
    fuses: int = 0       # fused operations (bit 0 Compare and Write)

    @property
    def compare_and_write(self) -> bool:
        """Fused Compare + Write: what a multi-node ownership table can be updated with."""
        return bool(self.oncs & 1 and self.fuses & 1)

    @property
    def reservations(self) -> bool:
        return bool(self.oncs & (1 << 5))

    @classmethod
    def parse(cls, b: bytes) -> "ControllerId":
        if len(b) != 4096:
            raise ProtocolError(f"Identify Controller returned {len(b)} bytes")
        vid, ssvid = struct.unpack_from("<HH", b, 0)
        mdts = b[77]
        cntlid, ver = struct.unpack_from("<HI", b, 78)
        (kas,) = struct.unpack_from("<H", b, 320)
        sqes, cqes, maxcmd, nn = struct.unpack_from("<BBHI", b, 512)
        oncs, fuses = struct.unpack_from("<HH", b, 520)
        (sgls,) = struct.unpack_from("<I", b, 536)
        ioccsz, iorcsz, icdoff = struct.unpack_from("<IIH", b, 1792)
        return cls(vid, ssvid, _text(b[4:24]), _text(b[24:64]), _text(b[64:72]), mdts, cntlid, ver,
                   kas, sqes, cqes, maxcmd, nn, sgls, _text(b[768:1024]), ioccsz, iorcsz, icdoff, b[1803], oncs, fuses)


@dataclasses.dataclass(frozen=True)
class NamespaceId:
    nsid: int
    nsze: int            # size in logical blocks
    ncap: int
    nuse: int
    lba_size: int
    metadata: int
    nguid: str
    eui64: str

    @property
    def size(self) -> int:
        return self.nsze * self.lba_size

    @classmethod
    def parse(cls, nsid: int, b: bytes) -> "NamespaceId":
        if len(b) != 4096:
            raise ProtocolError(f"Identify Namespace returned {len(b)} bytes")
        nsze, ncap, nuse = struct.unpack_from("<QQQ", b, 0)
        nlbaf, flbas = b[25], b[26]
        idx = (flbas & 0x0F) | ((flbas >> 1) & 0x30)
        if idx > nlbaf or idx >= 64:
            raise ProtocolError(f"namespace {nsid}: format index {idx} > NLBAF {nlbaf}")
        ms, lbads, _rp = struct.unpack_from("<HBB", b, 128 + 4 * idx)
        if not 9 <= lbads <= 16:
            raise ProtocolError(f"namespace {nsid}: unsupported LBA data size 2**{lbads}")
        return cls(nsid, nsze, ncap, nuse, 1 << lbads, ms, b[104:120].hex(), b[120:128].hex())


@dataclasses.dataclass(frozen=True)
class Cap:
    raw: int

    @property
    def mqes(self) -> int:          # maximum queue entries (1-based)
        return (self.raw & 0xFFFF) + 1

    @property
    def timeout_s(self) -> float:   # CAP.TO: worst-case time to RDY, 500 ms units
        return ((self.raw >> 24) & 0xFF) * 0.5

    @property
    def mpsmin(self) -> int:
        return 4096 << ((self.raw >> 48) & 0xF)


def version_str(vs: int) -> str:
    return f"{vs >> 16}.{(vs >> 8) & 0xFF}" + (f".{vs & 0xFF}" if vs & 0xFF else "")
