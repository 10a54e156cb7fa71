"""Protocol robustness: a small fake target that sends malformed PDUs.

This is the one place a fake is right: the real target never misbehaves on purpose.
Every case must end in a clean TransportError subclass within the command timeout —
never a hang, a crash, or bytes written outside the caller's buffer.
"""
from __future__ import annotations

import functools
import re
import struct

import pytest
import trio

from kvfs.remote import pdu as P
from kvfs.remote.errors import CommandTimeout, ProtocolError, TargetTerminated, TransportError
from kvfs.remote.queue import Queue

TIMEOUT = 1.0


def icresp(pfv=0, cpda=0, digest=0, maxdata=1 << 20, ptype=P.ICRESP, hlen=128, plen=128) -> bytes:
    return P.COMMON.pack(ptype, 0, hlen, 0, plen) + P.ICRESP_BODY.pack(pfv, cpda, digest, maxdata) + bytes(112)


def cqe(cid: int, status: int = 0, hlen=24, plen=24, ptype=P.CAPSULE_RESP, result=0) -> bytes:
    return P.COMMON.pack(ptype, 0, hlen, 0, plen) + P.CQE.pack(result, 0, 0, cid, status << 1)


def c2h(cid: int, off: int, data: bytes, flags=P.F_LAST | P.F_SUCCESS, plen=None, pdo=24) -> bytes:
    plen = pdo + len(data) if plen is None else plen
    return (P.COMMON.pack(P.C2H_DATA, flags, 24, pdo, plen) + P.DATA_HDR.pack(cid, 0, off, len(data))
            + bytes(pdo - 24) + data)


async def recv_exact(stream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


async def handshake(stream, **kw) -> None:
    await recv_exact(stream, 128)
    await stream.send_all(icresp(**kw))


async def read_capsule(stream, hdgst=False) -> int:
    hdr = await recv_exact(stream, 8)
    _t, _f, hlen, pdo, plen = P.COMMON.unpack(hdr)
    rest = await recv_exact(stream, plen - 8)
    return struct.unpack_from("<H", hdr + rest, 10)[0]


async def run_case(handler, *, op="read", hdgst=False, ddgst=False):
    """Serve one connection with ``handler``; return what the client raised (or None)."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        err = None
        with trio.fail_after(TIMEOUT * 5):           # a hang fails the test
            q = None
            buf = bytearray(b"\xAA" * 8192)          # the command owns the first 4096 bytes only
            try:
                q = await Queue.open("127.0.0.1", port, 1, 32, timeout=TIMEOUT, hdgst=hdgst, ddgst=ddgst)
                if op == "read":
                    await q.execute(P.sqe(P.IO_READ, nsid=1, cdw12=7), read_into=memoryview(buf)[:4096])
                elif op == "write":
                    await q.execute(P.sqe(P.IO_WRITE, nsid=1, cdw12=7), write=bytes(4096))
                else:
                    await q.execute(P.sqe(P.IO_FLUSH, nsid=1))
            except TransportError as e:
                err = e
                if q is not None:        # the queue is dead: later commands fail at once, same error
                    assert q.broken is e
                    with trio.fail_after(0.1):
                        with pytest.raises(TransportError):
                            await q.execute(P.sqe(P.IO_FLUSH, nsid=1))
            assert buf[4096:] == b"\xAA" * 4096
        nursery.cancel_scope.cancel()
    return err


def case(fn):
    async def handler(stream):
        try:
            await fn(stream)
            await trio.sleep_forever()   # keep the connection open: the client must not wait for EOF
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    return handler


async def _wrong_icresp_type(s):
    await recv_exact(s, 128)
    await s.send_all(cqe(0, plen=24)[:24] + bytes(104))


async def _bad_pfv(s):
    await handshake(s, pfv=1)


async def _bad_maxdata(s):
    await handshake(s, maxdata=0)


async def _unasked_digest(s):
    await handshake(s, digest=P.DIGEST_DATA)


async def _close_at_once(s):
    await s.aclose()


async def _silent(s):
    await recv_exact(s, 128)


@pytest.mark.parametrize("server, exc, match", [
    (_wrong_icresp_type, ProtocolError, "expected ICResp"),
    (_bad_pfv, ProtocolError, "version"),
    (_bad_maxdata, ProtocolError, "MAXH2CDATA"),
    (_unasked_digest, ProtocolError, "digests"),
    (_close_at_once, TransportError, "closed|reset"),
    (_silent, CommandTimeout, "ICResp"),
])
async def test_bad_connection_setup(server, exc, match):
    err = await run_case(case(server))
    assert isinstance(err, exc) and err.args and re.search(match, str(err)), err


def after_capsule(reply):
    async def fn(s):
        await handshake(s)
        cid = await read_capsule(s)
        await s.send_all(reply(cid))
    return fn


MALFORMED = {
    "short header length": (lambda cid: cqe(cid, hlen=16, plen=16), "header length"),
    "unknown PDU type": (lambda cid: P.COMMON.pack(0x0F, 0, 24, 0, 24) + bytes(16), "unexpected PDU"),
    "ICResp after setup": (lambda cid: icresp(), "unexpected PDU"),
    "unknown command id": (lambda cid: cqe(cid + 1), "unknown command id"),
    "huge plen": (lambda cid: cqe(cid, plen=1 << 31), "plen"),
    "data beyond buffer": (lambda cid: c2h(cid, 4000, b"x" * 200), r"\[4000, \+200\)"),
    "data out of order": (lambda cid: c2h(cid, 512, b"x" * 512, flags=0), "expected offset 0"),
    "plen/datal mismatch": (lambda cid: c2h(cid, 0, b"x" * 512, plen=24 + 4096), "carries"),
    "pdo inside header": (lambda cid: P.COMMON.pack(P.C2H_DATA, P.F_LAST, 24, 8, 24 + 4096)
                          + P.DATA_HDR.pack(cid, 0, 0, 4096), "pdo"),
    "SUCCESS without LAST": (lambda cid: c2h(cid, 0, b"x" * 4096, flags=P.F_SUCCESS), "SUCCESS"),
    "SUCCESS before all data": (lambda cid: c2h(cid, 0, b"x" * 512), "before all data"),
    "completion without data": (lambda cid: cqe(cid), "0 of 4096"),
    "R2T for a read": (lambda cid: P.COMMON.pack(P.R2T, 0, 24, 0, 24) + P.DATA_HDR.pack(cid, 1, 0, 4096), "R2T"),
    "C2HTermReq": (lambda cid: P.COMMON.pack(P.C2H_TERM, 0, 24, 0, 24) + P.TERM_BODY.pack(1, 0) + bytes(10), "terminated"),
    "EOF mid data": (lambda cid: c2h(cid, 0, b"x" * 4096)[:24 + 100], "closed by the target mid-PDU"),
    "stalls mid data": (lambda cid: c2h(cid, 0, b"x" * 4096)[:24 + 100], "stalled|timed out"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_malformed_pdus_fail_cleanly(name):
    reply, match = MALFORMED[name]
    fn = after_capsule(reply)
    if name == "EOF mid data":
        inner = fn

        async def fn(s):
            await inner(s)
            await s.aclose()
    err = await run_case(case(fn))
    assert isinstance(err, TransportError), f"{name}: no error"
    if name == "C2HTermReq":
        assert isinstance(err, TargetTerminated)
    assert re.search(match, str(err)), f"{name}: {err}"


async def test_r2t_violations():
    async def bad_r2t(s):
        await handshake(s)
        cid = await read_capsule(s)
        await s.send_all(P.COMMON.pack(P.R2T, 0, 24, 0, 24) + P.DATA_HDR.pack(cid, 1, 2048, 4096))
    err = await run_case(case(bad_r2t), op="write")
    assert isinstance(err, ProtocolError) and "asks for" in str(err)

    async def early_done(s):
        await handshake(s)
        cid = await read_capsule(s)
        await s.send_all(cqe(cid))
    err = await run_case(case(early_done), op="write")
    assert isinstance(err, ProtocolError) and "before all data" in str(err)


async def test_header_digest_mismatch_and_fragmented_pdus():
    async def bad_digest(s):
        await recv_exact(s, 128)
        await s.send_all(icresp(digest=P.DIGEST_HEADER))
        hdr = await recv_exact(s, 8)
        plen = P.COMMON.unpack(hdr)[4]
        rest = await recv_exact(s, plen - 8)
        cid = struct.unpack_from("<H", hdr + rest, 10)[0]
        h = P.COMMON.pack(P.CAPSULE_RESP, P.F_HDGST, 24, 0, 28) + P.CQE.pack(0, 0, 0, cid, 0)
        await s.send_all(h + struct.pack("<I", P.crc32c(h) ^ 1))
    err = await run_case(case(bad_digest), op="flush", hdgst=True)
    assert isinstance(err, ProtocolError) and "header digest mismatch" in str(err)

    async def dribble(s):             # a valid exchange, one byte per segment: must succeed
        await recv_exact(s, 128)
        for b in icresp():
            await s.send_all(bytes([b]))
        cid = await read_capsule(s)
        for b in c2h(cid, 0, bytes(range(256)) * 16):
            await s.send_all(bytes([b]))
    assert await run_case(case(dribble)) is None


async def test_data_digest_mismatch():
    async def bad(s):
        await recv_exact(s, 128)
        await s.send_all(icresp(digest=P.DIGEST_DATA))
        cid = await read_capsule(s)
        data = b"y" * 4096
        pdu = (P.COMMON.pack(P.C2H_DATA, P.F_LAST | P.F_SUCCESS | P.F_DDGST, 24, 24, 24 + 4096 + 4)
               + P.DATA_HDR.pack(cid, 0, 0, 4096) + data + struct.pack("<I", P.crc32c(data) ^ 0xFF))
        await s.send_all(pdu)
    err = await run_case(case(bad), ddgst=True)
    assert isinstance(err, ProtocolError) and "data digest mismatch" in str(err)
