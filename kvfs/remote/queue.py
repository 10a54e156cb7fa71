"""One NVMe/TCP queue: a TCP connection carrying command capsules and their data.

No background task: receiving is done by whichever waiting task is the current
*leader* (leader/follower). A task that submitted a command waits; if nobody is
reading the socket it becomes the leader and reads PDUs — completing its own and
other tasks' commands, answering R2Ts — until its own command is done, then hands
the socket to another waiter. So a queue needs no nursery and lives as long as
its object.

Every PDU is validated before anything is done with it (type, header length,
PDU length and data offset, command id in flight, data offsets and lengths
within the command's buffer, digests). Any violation, an EOF, a socket error or
a command that outlives its deadline marks the queue *broken*: the socket is
closed and every command in flight fails with that TransportError.
"""
from __future__ import annotations

import logging
import socket as _socket
import struct

import trio

from kvfs.remote import pdu as P
from kvfs.remote.errors import (CommandTimeout, NvmeStatusError, ProtocolError, TargetTerminated,
                                TransportError)

log = logging.getLogger(__name__)

_RBUF = 256 * 1024
_LOWAT_MAX = 1 << 20        # receive low-water mark while a large PDU's data is arriving
_LOWAT_MIN = 16 * 1024       # below this, wake up for any data
_MAX_TERM_PLEN = 4096


class _Cmd:
    __slots__ = ("cid", "opcode", "buf", "length", "received", "write", "sent", "r2t_busy",
                 "done", "result", "status", "exc", "wake", "what")

    def __init__(self, cid: int, opcode: int, what: str):
        self.cid = cid
        self.opcode = opcode
        self.what = what
        self.buf: memoryview | None = None     # read destination
        self.write: memoryview | None = None   # write source (R2T-driven)
        self.length = 0
        self.received = 0
        self.sent = 0
        self.r2t_busy = False
        self.done = False
        self.result = 0
        self.status = 0
        self.exc: BaseException | None = None
        self.wake = trio.Event()


class Queue:
    """One connected queue (qid 0 is the admin queue). Create with ``await Queue.open(...)``."""

    def __init__(self, qid: int, depth: int, *, timeout: float, hdgst: bool, ddgst: bool):
        self.qid = qid
        self.depth = depth
        self.timeout = timeout
        self.want_hdgst, self.want_ddgst = hdgst, ddgst
        self.hdgst = self.ddgst = False
        self.cpda = 0
        self.maxh2cdata = 0
        self.inline_max = 0            # bytes of write data that may go in the capsule
        self.sock: trio.socket.SocketType | None = None
        self.broken: TransportError | None = None
        self._inflight: dict[int, _Cmd] = {}
        self._free = list(range(depth - 1, -1, -1))
        self._slots = trio.Semaphore(depth)
        self._send_lock = trio.Lock()
        self._rx_busy = False
        self._tcp_up = False
        self._waiting: set[_Cmd] = set()
        self._rbuf = bytearray(_RBUF)
        self._rview = memoryview(self._rbuf)
        self._rs = self._re = 0
        self.commands = 0
        self.peak_inflight = 0
        self.r2ts = 0
        self.inline_writes = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.recvs = 0
        self._lowat = 1

    @property
    def inflight(self) -> int:
        """Commands sent and not answered yet."""
        return len(self._inflight)

    # connection ----------------------------------------------------------
    @classmethod
    async def open(cls, host: str, port: int, qid: int, depth: int, *, timeout: float,
                   hdgst: bool = False, ddgst: bool = False) -> "Queue":
        q = cls(qid, depth, timeout=timeout, hdgst=hdgst, ddgst=ddgst)
        try:
            with trio.fail_after(timeout):
                await q._connect(host, port)
        except trio.TooSlowError:
            q._fail(CommandTimeout(f"queue {qid}: no ICResp from {host}:{port} within {timeout} s"))
            raise q.broken from None
        except OSError as e:
            q._fail(TransportError(f"queue {qid}: cannot connect to {host}:{port}: {e.strerror or e}"
                                   + (" (during ICReq/ICResp)" if q._tcp_up else "")))
            raise q.broken from None
        except TransportError as e:
            q._fail(e)
            raise
        return q

    async def _connect(self, host: str, port: int) -> None:
        infos = await trio.socket.getaddrinfo(host, port, type=_socket.SOCK_STREAM)
        if not infos:
            raise TransportError(f"cannot resolve {host}")
        fam, typ, proto, _, addr = infos[0]
        self.sock = trio.socket.socket(fam, typ, proto)
        self.sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
        await self.sock.connect(addr)
        self._tcp_up = True
        digest = (P.DIGEST_HEADER if self.want_hdgst else 0) | (P.DIGEST_DATA if self.want_ddgst else 0)
        await self._send_raw([P.icreq(hpda=0, digest=digest, maxr2t=0)])
        hdr = await self._peek(8)
        ptype, flags, hlen, pdo, plen = P.COMMON.unpack_from(hdr)
        if ptype != P.ICRESP or hlen != 128 or plen != 128 or pdo != 0:
            raise ProtocolError(f"expected ICResp, got type {ptype:#x} hlen {hlen} plen {plen}")
        body = bytes(await self._peek(128))
        self._consume(128)
        pfv, cpda, dgst, maxdata = P.ICRESP_BODY.unpack_from(body, 8)
        if pfv != 0:
            raise ProtocolError(f"unsupported PDU format version {pfv}")
        if dgst & ~digest:
            raise ProtocolError(f"target enabled digests we did not ask for ({dgst:#x})")
        if maxdata < 4096 or maxdata % 4:
            raise ProtocolError(f"invalid MAXH2CDATA {maxdata}")
        self.hdgst, self.ddgst = bool(dgst & P.DIGEST_HEADER), bool(dgst & P.DIGEST_DATA)
        self.cpda, self.maxh2cdata = cpda, maxdata
        self.inline_max = 8192 if self.qid == 0 else 0   # raised from IOCCSZ after Identify

    def close(self) -> None:
        self._fail(TransportError(f"queue {self.qid} closed"))

    def _fail(self, exc: TransportError) -> None:
        if self.broken is not None:
            return
        self.broken = exc
        if self.sock is not None:
            self.sock.close()
        for c in list(self._inflight.values()):
            c.exc, c.done = exc, True
            c.wake.set()
            self._slots.release()
        self._inflight.clear()
        for c in self._waiting:
            c.wake.set()

    # submission ----------------------------------------------------------
    async def execute(self, cmd: bytearray, *, read_into: memoryview | None = None,
                      write: memoryview | bytes | None = None, timeout: float | None = None,
                      what: str = "") -> int:
        """Run one command; return CQE dword 0-1 (``result``). Raises NvmeStatusError on error status."""
        if self.broken:
            raise self.broken
        deadline = trio.current_time() + (timeout or self.timeout)
        with trio.move_on_at(deadline) as cs:
            await self._slots.acquire()
        if cs.cancelled_caught:
            raise CommandTimeout(f"queue {self.qid}: no free command slot within {self.timeout} s")
        if self.broken:
            self._slots.release()
            raise self.broken
        cid = self._free.pop()
        c = _Cmd(cid, cmd[0], what)
        self._inflight[cid] = c
        self.peak_inflight = max(self.peak_inflight, len(self._inflight))
        P.set_cid(cmd, cid)
        parts: list = []
        hd = 4 if self.hdgst else 0
        if write is not None and len(write) <= self.inline_max:
            n = len(write)
            P.set_sgl(cmd, P.SGL_INCAPSULE, n)
            c.length = c.sent = n
            self.inline_writes += 1
            pdo = self._align(P.CAPSULE_CMD_HLEN + hd)
            dd = 4 if self.ddgst and n else 0
            plen = pdo + n + dd if n else P.CAPSULE_CMD_HLEN + hd
            flags = (P.F_HDGST if self.hdgst else 0) | (P.F_DDGST if dd else 0)
            h = P.common_header(P.CAPSULE_CMD, flags, P.CAPSULE_CMD_HLEN, pdo if n else 0, plen) + bytes(cmd)
            parts.append(h)
            if hd:
                parts.append(struct.pack("<I", P.crc32c(h)))
            if n:
                parts.append(bytes(pdo - P.CAPSULE_CMD_HLEN - hd))
                parts.append(write)
                if dd:
                    parts.append(struct.pack("<I", P.crc32c(write)))
        else:
            if write is not None:
                c.write, c.length = memoryview(write), len(write)
            elif read_into is not None:
                c.buf, c.length = read_into, len(read_into)
            P.set_sgl(cmd, P.SGL_TRANSPORT, c.length)
            h = P.common_header(P.CAPSULE_CMD, P.F_HDGST if hd else 0, P.CAPSULE_CMD_HLEN, 0,
                                P.CAPSULE_CMD_HLEN + hd) + bytes(cmd)
            parts.append(h)
            if hd:
                parts.append(struct.pack("<I", P.crc32c(h)))
        self.commands += 1
        await self._send(parts)
        await self._wait(c, deadline)
        if c.exc is not None:
            raise c.exc
        if c.status:
            raise NvmeStatusError(c.opcode, c.status, what)
        return c.result

    def _align(self, off: int) -> int:
        a = (self.cpda + 1) * 4
        return (off + a - 1) // a * a

    async def _send(self, parts: list) -> None:
        """Send whole PDUs; a send cut short breaks the queue (the stream is corrupt)."""
        with trio.CancelScope(shield=True, deadline=trio.current_time() + self.timeout) as cs:
            async with self._send_lock:
                if self.broken:
                    raise self.broken
                try:
                    await self._send_raw(parts)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    self._fail(TransportError(f"queue {self.qid}: send failed: {e}"))
        if cs.cancelled_caught:
            self._fail(CommandTimeout(f"queue {self.qid}: send stalled for {self.timeout} s"))
        if self.broken:
            raise self.broken

    async def _send_raw(self, parts: list) -> None:
        if sum(len(p) for p in parts) <= 65536:
            parts = [b"".join(parts)]
        for p in parts:
            view = memoryview(p).cast("B")
            while view:
                n = await self.sock.send(view)
                self.bytes_out += n
                view = view[n:]

    # completion: leader/follower ------------------------------------------
    async def _wait(self, c: _Cmd, deadline: float) -> None:
        try:
            while not c.done:
                if self.broken:
                    raise self.broken
                if not self._rx_busy:
                    self._rx_busy = True
                    try:
                        with trio.move_on_at(deadline):
                            while not c.done:
                                await self._read_pdu()
                    except TransportError as e:
                        self._fail(e)
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                        self._fail(TransportError(f"queue {self.qid}: receive failed: {e}"))
                    finally:
                        self._rx_busy = False
                        self._handoff()
                else:
                    c.wake = trio.Event()
                    self._waiting.add(c)
                    try:
                        with trio.move_on_at(deadline):
                            await c.wake.wait()
                    finally:
                        self._waiting.discard(c)
                if not c.done and trio.current_time() >= deadline:
                    self._fail(CommandTimeout(f"queue {self.qid}: {c.what or f'opcode {c.opcode:#04x}'} "
                                              f"timed out after {self.timeout} s"))
        finally:
            self._handoff()    # we may have been woken to lead just as we finished

    def _handoff(self) -> None:
        """If nobody reads the socket, wake one waiter whose command is still pending to lead."""
        if self._rx_busy:
            return
        for other in self._waiting:
            if not other.done:
                other.wake.set()
                return

    def _complete(self, c: _Cmd, result: int, status: int) -> None:
        del self._inflight[c.cid]
        self._free.append(c.cid)
        self._slots.release()
        c.result, c.status, c.done = result, status, True
        c.wake.set()

    async def _peek(self, n: int) -> memoryview:
        """Buffer at least n bytes of the stream and return them without consuming."""
        while self._re - self._rs < n:
            if len(self._rbuf) - self._rs < n:
                have = self._re - self._rs
                self._rbuf[0:have] = self._rbuf[self._rs:self._re]
                self._rs, self._re = 0, have
            k = await self.sock.recv_into(self._rview[self._re:])
            if k == 0:
                raise TransportError(f"queue {self.qid}: connection closed by the target")
            self._re += k
            self.bytes_in += k
            self.recvs += 1
        return self._rview[self._rs:self._rs + n]

    def _consume(self, n: int) -> None:
        self._rs += n
        if self._rs == self._re:
            self._rs = self._re = 0

    async def _recv_into(self, dst: memoryview) -> None:
        """Receive exactly len(dst) bytes (PDU data) straight into the caller's buffer.

        A target streams a large C2HData PDU in small segments; waking up for each one
        costs more CPU than the copy. While much of the PDU is still to come, the socket's
        receive low-water mark asks the kernel to report it readable only once a good
        part of it has arrived (one wake-up per ``_LOWAT_MAX`` bytes instead of per segment).
        """
        have = min(self._re - self._rs, len(dst))
        if have:
            dst[:have] = self._rview[self._rs:self._rs + have]
            self._consume(have)
        pos = have
        try:
            while pos < len(dst):
                self._set_lowat(min(len(dst) - pos, _LOWAT_MAX))
                k = await self.sock.recv_into(dst[pos:])
                if k == 0:
                    raise TransportError(f"queue {self.qid}: connection closed by the target mid-PDU")
                pos += k
                self.bytes_in += k
                self.recvs += 1
        finally:
            self._set_lowat(1)

    def _set_lowat(self, n: int) -> None:
        n = max(1, n if n >= _LOWAT_MIN else 1)
        if n != self._lowat and self.sock is not None and self.broken is None:
            try:
                self.sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVLOWAT, n)
                self._lowat = n
            except OSError:
                pass

    async def _skip(self, n: int) -> None:
        if n:
            await self._peek(n)
            self._consume(n)

    async def _read_pdu(self) -> None:
        # Waiting for the start of a PDU may be cancelled cleanly: nothing is consumed
        # until the whole header (and its digest) is buffered and valid.
        hdr = await self._peek(8)
        ptype, flags, hlen, pdo, plen = P.COMMON.unpack_from(hdr)
        name = P.PDU_NAMES.get(ptype, f"type {ptype:#x}")
        if ptype not in (P.CAPSULE_RESP, P.C2H_DATA, P.R2T, P.C2H_TERM):
            raise ProtocolError(f"queue {self.qid}: unexpected PDU {name}")
        if hlen != P.HLEN[ptype]:
            raise ProtocolError(f"queue {self.qid}: {name} with header length {hlen}")
        if ptype == P.C2H_TERM:
            await self._on_term(hlen, plen)
        hd = 4 if self.hdgst else 0
        if bool(flags & P.F_HDGST) != self.hdgst:
            raise ProtocolError(f"queue {self.qid}: {name} header-digest flag does not match negotiation")
        if ptype == P.C2H_DATA:
            dd = 4 if self.ddgst else 0
            if bool(flags & P.F_DDGST) != self.ddgst:
                raise ProtocolError(f"queue {self.qid}: C2HData data-digest flag does not match negotiation")
            if not hlen + hd <= pdo < plen - dd:
                raise ProtocolError(f"queue {self.qid}: C2HData with pdo {pdo} plen {plen}")
        elif pdo != 0 or plen != hlen + hd:
            raise ProtocolError(f"queue {self.qid}: {name} with pdo {pdo} plen {plen}")
        h = bytes(await self._peek(hlen + hd))
        if hd and struct.unpack_from("<I", h, hlen)[0] != P.crc32c(h[:hlen]):
            raise ProtocolError(f"queue {self.qid}: {name} header digest mismatch")
        if ptype == P.CAPSULE_RESP:
            self._consume(hlen + hd)
            self._on_response(h)
            return
        cid, ttag, off, length = P.DATA_HDR.unpack_from(h, 8)
        c = self._inflight.get(cid)
        if c is None:
            raise ProtocolError(f"queue {self.qid}: {name} for unknown command id {cid}")
        if ptype == P.R2T:
            self._consume(hlen + hd)
            if c.write is None or c.r2t_busy:
                raise ProtocolError(f"queue {self.qid}: unexpected R2T for command {cid}")
            if length == 0 or off != c.sent or off + length > c.length:
                raise ProtocolError(f"queue {self.qid}: R2T for command {cid} asks for "
                                    f"[{off}, +{length}) of {c.length} (sent {c.sent})")
            await self._answer_r2t(c, ttag, off, length)
            return
        await self._on_c2h_data(c, flags, hlen, hd, pdo, plen, off, length, cid)

    async def _on_term(self, hlen: int, plen: int) -> None:
        if not hlen <= plen <= _MAX_TERM_PLEN:
            raise ProtocolError(f"queue {self.qid}: C2HTermReq with length {plen}")
        body = bytes(await self._peek(plen))
        self._consume(plen)
        fes, fei = P.TERM_BODY.unpack_from(body, 8)
        raise TargetTerminated(f"queue {self.qid}: target terminated the connection "
                               f"(fatal error status {fes:#x}, info {fei:#x})")

    def _on_response(self, h: bytes) -> None:
        result, _sqhd, _sqid, cid, status = P.CQE.unpack_from(h, 8)
        c = self._inflight.get(cid)
        if c is None:
            raise ProtocolError(f"queue {self.qid}: response for unknown command id {cid}")
        status >>= 1
        if not status and c.buf is not None and c.received != c.length:
            raise ProtocolError(f"queue {self.qid}: command {cid} completed with "
                                f"{c.received} of {c.length} data bytes")
        if not status and c.write is not None and c.sent != c.length:
            raise ProtocolError(f"queue {self.qid}: write {cid} completed before all data was requested")
        self._complete(c, result, status)

    async def _on_c2h_data(self, c: _Cmd, flags: int, hlen: int, hd: int, pdo: int, plen: int,
                           off: int, length: int, cid: int) -> None:
        dd = 4 if self.ddgst else 0
        if c.buf is None:
            raise ProtocolError(f"queue {self.qid}: C2HData for non-read command {cid}")
        if length != plen - pdo - dd or length == 0 or off != c.received or off + length > c.length:
            raise ProtocolError(f"queue {self.qid}: C2HData for command {cid} carries "
                                f"[{off}, +{length}) plen {plen} (expected offset {c.received} of {c.length})")
        if flags & P.F_SUCCESS and not flags & P.F_LAST:
            raise ProtocolError(f"queue {self.qid}: C2HData with SUCCESS but not LAST_PDU")
        if flags & P.F_SUCCESS and off + length != c.length:
            raise ProtocolError(f"queue {self.qid}: C2HData SUCCESS before all data ({off + length}/{c.length})")
        self._consume(hlen + hd)
        # From here the PDU is half read: a cancellation would corrupt the stream.
        with trio.CancelScope(shield=True, deadline=trio.current_time() + self.timeout) as cs:
            await self._skip(pdo - hlen - hd)
            dst = c.buf[off:off + length]
            await self._recv_into(dst)
            if dd:
                (got,) = struct.unpack("<I", await self._peek(4))
                self._consume(4)
                if got != P.crc32c(dst):
                    raise ProtocolError(f"queue {self.qid}: C2HData data digest mismatch (command {cid})")
        if cs.cancelled_caught:
            raise CommandTimeout(f"queue {self.qid}: C2HData stalled mid-PDU")
        c.received += length
        if flags & P.F_SUCCESS:
            self._complete(c, 0, 0)

    async def _answer_r2t(self, c: _Cmd, ttag: int, off: int, length: int) -> None:
        hd = 4 if self.hdgst else 0
        dd = 4 if self.ddgst else 0
        pdo = self._align(P.H2C_DATA_HLEN + hd)
        pad = bytes(pdo - P.H2C_DATA_HLEN - hd)
        end = off + length
        c.r2t_busy = True
        self.r2ts += 1
        pos = off
        while pos < end:
            n = min(self.maxh2cdata, end - pos)
            data = c.write[pos:pos + n]
            flags = (P.F_HDGST if hd else 0) | (P.F_DDGST if dd else 0) | (P.F_LAST if pos + n == end else 0)
            h = P.common_header(P.H2C_DATA, flags, P.H2C_DATA_HLEN, pdo, pdo + n + dd) + \
                P.DATA_HDR.pack(c.cid, ttag, pos, n)
            parts = [h]
            if hd:
                parts.append(struct.pack("<I", P.crc32c(h)))
            parts += [pad, data]
            if dd:
                parts.append(struct.pack("<I", P.crc32c(data)))
            await self._send(parts)
            pos += n
        c.sent = end
        c.r2t_busy = False
