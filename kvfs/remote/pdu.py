"""NVMe/TCP PDU and NVMe command layouts (NVMe/TCP transport spec 1.0, NVMe base 2.0).

Everything is little-endian. A PDU starts with an 8-byte common header
(type, flags, hlen, pdo, plen); ``hlen`` is fixed per type, an optional 4-byte
header digest follows it, then (for PDUs with data) padding up to ``pdo``, the
data and an optional 4-byte data digest. Digests are CRC32C.
"""
from __future__ import annotations

import struct

import crc32c as _crc32c

# PDU types
ICREQ, ICRESP, H2C_TERM, C2H_TERM, CAPSULE_CMD, CAPSULE_RESP, H2C_DATA, C2H_DATA, R2T = (
    0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x09)
PDU_NAMES = {ICREQ: "ICReq", ICRESP: "ICResp", H2C_TERM: "H2CTermReq", C2H_TERM: "C2HTermReq",
             CAPSULE_CMD: "CapsuleCmd", CAPSULE_RESP: "CapsuleResp", H2C_DATA: "H2CData",
             C2H_DATA: "C2HData", R2T: "R2T"}

# common-header flags
F_HDGST, F_DDGST, F_LAST, F_SUCCESS = 0x01, 0x02, 0x04, 0x08

# fixed header lengths of what a controller may send
HLEN = {ICRESP: 128, C2H_TERM: 24, CAPSULE_RESP: 24, C2H_DATA: 24, R2T: 24}
CAPSULE_CMD_HLEN = 72
H2C_DATA_HLEN = 24
ICREQ_LEN = 128

COMMON = struct.Struct("<BBBBI")                 # type, flags, hlen, pdo, plen
ICREQ_FMT = struct.Struct("<BBBBIHBBI112x")      # + pfv, hpda, digest, maxr2t
ICRESP_BODY = struct.Struct("<HBBI")             # pfv, cpda, digest, maxh2cdata (at offset 8)
DATA_HDR = struct.Struct("<HHII4x")              # cccid, ttag, data offset, data length (C2H/H2C/R2T)
CQE = struct.Struct("<QHHHH")                    # result, sq head, sq id, command id, status
TERM_BODY = struct.Struct("<HI")                 # fes, fei

DIGEST_HEADER, DIGEST_DATA = 0x01, 0x02

# SGL descriptor types (type << 4 | subtype)
SGL_INCAPSULE = 0x01        # data block, offset: data follows the SQE in the capsule
SGL_TRANSPORT = 0x5A        # transport data block: the transport moves it (C2HData / R2T+H2CData)
PSDT_SGL = 0x40             # command flags: SGLs for data

# opcodes
ADMIN_IDENTIFY, ADMIN_SET_FEATURES, ADMIN_KEEP_ALIVE = 0x06, 0x09, 0x18
IO_FLUSH, IO_WRITE, IO_READ = 0x00, 0x01, 0x02
FABRICS = 0x7F
FCTYPE_PROP_SET, FCTYPE_CONNECT, FCTYPE_PROP_GET = 0x00, 0x01, 0x04

# controller properties
REG_CAP, REG_VS, REG_CC, REG_CSTS = 0x00, 0x08, 0x14, 0x1C

SQE = struct.Struct("<BBHIQQQIBBBBIIIIII")  # opcode flags cid nsid cdw2-3 mptr sgl.addr sgl.len 3xrsvd sgl.type cdw10..15
assert SQE.size == 64


def crc32c(data) -> int:
    return _crc32c.crc32c(data)


def sqe(opcode: int, *, nsid: int = 0, sgl_type: int = SGL_TRANSPORT, sgl_len: int = 0,
        cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0, cdw14: int = 0,
        cdw15: int = 0) -> bytearray:
    """A 64-byte submission queue entry with an SGL data descriptor; command id set later."""
    return bytearray(SQE.pack(opcode, PSDT_SGL, 0, nsid, 0, 0, 0, sgl_len, 0, 0, 0, sgl_type,
                              cdw10, cdw11, cdw12, cdw13, cdw14, cdw15))


def set_cid(cmd: bytearray, cid: int) -> None:
    struct.pack_into("<H", cmd, 2, cid)


def set_sgl(cmd: bytearray, sgl_type: int, length: int) -> None:
    struct.pack_into("<QI3xB", cmd, 24, 0, length, sgl_type)


def fabrics(fctype: int, body: bytes = b"", at: int = 40) -> bytearray:
    """A fabrics command: opcode 0x7F, fctype at byte 4, command-specific bytes from ``at``."""
    cmd = sqe(FABRICS)
    cmd[4] = fctype
    cmd[at:at + len(body)] = body
    return cmd


def connect_cmd(qid: int, sqsize: int, kato_ms: int) -> bytearray:
    """Fabrics Connect: recfmt 0, qid, sqsize (0's based), cattr 0, kato (ms)."""
    return fabrics(FCTYPE_CONNECT, struct.pack("<HHHBxI", 0, qid, sqsize - 1, 0, kato_ms))


def connect_data(hostid: bytes, cntlid: int, subnqn: str, hostnqn: str) -> bytes:
    buf = bytearray(1024)
    buf[0:16] = hostid
    struct.pack_into("<H", buf, 16, cntlid)
    s, h = subnqn.encode(), hostnqn.encode()
    if len(s) > 255 or len(h) > 255:
        raise ValueError("NQN longer than 255 bytes")
    buf[256:256 + len(s)] = s
    buf[512:512 + len(h)] = h
    return bytes(buf)


def prop_get(offset: int, size8: bool) -> bytearray:
    return fabrics(FCTYPE_PROP_GET, struct.pack("<B3xI", 1 if size8 else 0, offset))


def prop_set(offset: int, value: int, size8: bool = False) -> bytearray:
    return fabrics(FCTYPE_PROP_SET, struct.pack("<B3xIQ", 1 if size8 else 0, offset, value))


def icreq(hpda: int = 0, digest: int = 0, maxr2t: int = 0) -> bytes:
    return ICREQ_FMT.pack(ICREQ, 0, ICREQ_LEN, 0, ICREQ_LEN, 0, hpda, digest, maxr2t)


def common_header(ptype: int, flags: int, hlen: int, pdo: int, plen: int) -> bytes:
    return COMMON.pack(ptype, flags, hlen, pdo, plen)
