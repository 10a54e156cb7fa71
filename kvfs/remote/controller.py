"""The NVMe/TCP host: one admin queue, N I/O queues, identify, read/write/flush.

``Controller.connect(url)`` performs the whole bring-up: ICReq on each
connection, Fabrics Connect (admin queue with KATO, then I/O queues with the
returned controller id), Property Get CAP/VS, Property Set CC.EN and a wait for
CSTS.RDY bounded by CAP.TO, Identify Controller, Set Features (Number of
Queues) and Identify Namespace. Reads and writes of any length are split at the
controller's transfer limit (MDTS, ``max_io``) and spread over the I/O queues
with many commands in flight.
"""
from __future__ import annotations

import logging
import struct

import trio

from kvfs.remote import pdu as P
from kvfs.remote.errors import NvmeError, NvmeStatusError, ProtocolError, TransportError
from kvfs.remote.identify import Cap, ControllerId, NamespaceId, version_str
from kvfs.remote.queue import Queue
from kvfs.remote.url import RemoteUrl

log = logging.getLogger(__name__)

ADMIN_DEPTH = 32
_IO_WINDOW_PER_QUEUE = 4                  # commands one read/write keeps in flight per I/O queue
_CC_EN = 1 | (6 << 16) | (4 << 20)       # EN, NVM command set, 4 KiB pages, IOSQES 64 B, IOCQES 16 B


class Controller:
    def __init__(self, url: RemoteUrl):
        self.url = url
        self.admin: Queue | None = None
        self.io: list[Queue] = []
        self.cntlid = 0
        self.cap = Cap(0)
        self.vs = 0
        self.ident: ControllerId | None = None
        self.ns: NamespaceId | None = None
        self.max_xfer = 0
        self._rr = 0

    # bring-up ------------------------------------------------------------
    @classmethod
    async def connect(cls, url: RemoteUrl) -> "Controller":
        ctrl = cls(url)
        try:
            await ctrl._bring_up()
        except BaseException:
            ctrl.close()
            raise
        return ctrl

    async def _queue(self, qid: int, depth: int) -> Queue:
        u = self.url
        return await Queue.open(u.host, u.port, qid, depth, timeout=u.timeout, hdgst=u.hdgst, ddgst=u.ddgst)

    async def _connect_queue(self, q: Queue, cntlid: int, kato_ms: int) -> int:
        u = self.url
        data = P.connect_data(u.hostid, cntlid, u.subnqn, u.hostnqn)
        res = await q.execute(P.connect_cmd(q.qid, q.depth, kato_ms), write=memoryview(data),
                              what=f"Connect (queue {q.qid})")
        return res & 0xFFFF

    async def _bring_up(self) -> None:
        u = self.url
        self.admin = await self._queue(0, ADMIN_DEPTH)
        kato_ms = int(u.kato * 1000)
        self.cntlid = await self._connect_queue(self.admin, 0xFFFF, kato_ms)
        self.cap = Cap(await self.prop_get(P.REG_CAP, True))
        self.vs = await self.prop_get(P.REG_VS, False)
        csts = await self.prop_get(P.REG_CSTS, False)
        if not csts & 1:
            await self.admin.execute(P.prop_set(P.REG_CC, _CC_EN), what="Property Set CC.EN")
            wait = max(self.cap.timeout_s, 1.0)
            with trio.move_on_after(wait):
                while True:
                    csts = await self.prop_get(P.REG_CSTS, False)
                    if csts & 2:
                        raise TransportError("controller fatal status (CSTS.CFS) while enabling")
                    if csts & 1:
                        break
                    await trio.sleep(0.01)     # CSTS has no notification: poll within CAP.TO
            if not csts & 1:
                raise TransportError(f"controller not ready (CSTS.RDY) within CAP.TO = {wait} s")
        self.ident = ControllerId.parse(await self._identify(1, 0))
        ioccsz = self.ident.ioccsz * 16
        inline = max(0, ioccsz - 64) if self.ident.icdoff == 0 else 0
        lim = 0
        if self.ident.mdts:
            lim = (1 << self.ident.mdts) * self.cap.mpsmin
        nq = u.queues
        try:
            res = await self.admin.execute(
                P.sqe(P.ADMIN_SET_FEATURES, cdw10=0x07, cdw11=((nq - 1) << 16) | (nq - 1)),
                what="Set Features (Number of Queues)")
            nq = min(nq, (res & 0xFFFF) + 1, ((res >> 16) & 0xFFFF) + 1)
        except NvmeStatusError as e:
            log.info("Set Features (Number of Queues) not supported: %s", e)
        nsid = u.nsid or await self._first_namespace()
        self.ns = NamespaceId.parse(nsid, await self._identify(0, nsid))
        if self.ns.nsze == 0:
            raise TransportError(f"namespace {nsid} has zero size (not attached?)")
        lbs = self.ns.lba_size
        xfer = min(u.max_io, 65536 * lbs, lim or (1 << 40))
        self.max_xfer = xfer // lbs * lbs
        if self.max_xfer < lbs:
            raise ProtocolError(f"transfer limit {xfer} below the LBA size {lbs}")
        depth = min(u.depth, self.cap.mqes)
        for qid in range(1, nq + 1):
            q = await self._queue(qid, depth)
            self.io.append(q)
            q.inline_max = max(inline, 1024)      # Connect data always travels in the capsule
            await self._connect_queue(q, self.cntlid, 0)
            q.inline_max = inline
        log.info("connected to %s: controller %d (%s, NVMe %s), namespace %d: %d x %d B, %d I/O queues x %d",
                 u, self.cntlid, self.ident.model, version_str(self.vs), nsid, self.ns.nsze, lbs, nq, depth)

    async def _first_namespace(self) -> int:
        buf = bytearray(4096)
        await self.admin.execute(P.sqe(P.ADMIN_IDENTIFY, cdw10=0x02), read_into=memoryview(buf),
                                 what="Identify (active namespaces)")
        (nsid,) = struct.unpack_from("<I", buf, 0)
        if nsid == 0:
            raise TransportError(f"subsystem {self.url.subnqn} exports no namespace")
        return nsid

    async def _identify(self, cns: int, nsid: int) -> bytes:
        buf = bytearray(4096)
        await self.admin.execute(P.sqe(P.ADMIN_IDENTIFY, nsid=nsid, cdw10=cns), read_into=memoryview(buf),
                                 what=f"Identify (CNS {cns})")
        return bytes(buf)

    async def prop_get(self, offset: int, size8: bool) -> int:
        res = await self.admin.execute(P.prop_get(offset, size8), what=f"Property Get {offset:#x}")
        return res if size8 else res & 0xFFFFFFFF

    # state ---------------------------------------------------------------
    @property
    def broken(self) -> TransportError | None:
        for q in [self.admin, *self.io]:
            if q is None:
                return TransportError("not connected")
            if q.broken:
                return q.broken
        return None

    def close(self) -> None:
        for q in [self.admin, *self.io]:
            if q is not None:
                q.close()

    async def shutdown(self) -> None:
        """Normal shutdown (CC.SHN) then close; best effort within one command timeout."""
        if not self.broken:
            with trio.move_on_after(self.url.timeout):
                try:
                    await self.admin.execute(P.prop_set(P.REG_CC, _CC_EN | (1 << 14)), what="shutdown")
                except NvmeError:
                    pass
        self.close()

    async def keep_alive(self) -> None:
        await self.admin.execute(P.sqe(P.ADMIN_KEEP_ALIVE), what="Keep Alive")

    def statistics(self) -> dict:
        qs = [q for q in [self.admin, *self.io] if q]
        return {"commands": sum(q.commands for q in qs), "bytes_in": sum(q.bytes_in for q in qs),
                "bytes_out": sum(q.bytes_out for q in qs)}

    # I/O -----------------------------------------------------------------
    def _pick(self) -> Queue:
        best = None
        n = len(self.io)
        for i in range(n):
            q = self.io[(self._rr + i) % n]
            if best is None or q.inflight < best.inflight:
                best = q
        self._rr = (self._rr + 1) % n
        return best

    def _check(self, lba: int, nbytes: int) -> int:
        lbs = self.ns.lba_size
        if nbytes % lbs or lba < 0:
            raise ValueError(f"I/O of {nbytes} bytes at LBA {lba} is not in whole {lbs}-byte blocks")
        if lba + nbytes // lbs > self.ns.nsze:
            raise ValueError(f"I/O [{lba}, +{nbytes // lbs}) beyond the namespace ({self.ns.nsze} blocks)")
        return lbs

    async def _one(self, opcode: int, lba: int, view: memoryview) -> None:
        lbs = self.ns.lba_size
        nlb = len(view) // lbs
        cmd = P.sqe(opcode, nsid=self.ns.nsid, cdw10=lba & 0xFFFFFFFF, cdw11=lba >> 32, cdw12=nlb - 1)
        what = f"{'Read' if opcode == P.IO_READ else 'Write'} LBA {lba} x {nlb}"
        if opcode == P.IO_READ:
            await self._pick().execute(cmd, read_into=view, what=what)
        else:
            await self._pick().execute(cmd, write=view, what=what)

    async def _io(self, opcode: int, lba: int, view: memoryview) -> None:
        if self.broken:
            raise self.broken
        lbs = self._check(lba, len(view))
        step = self.max_xfer
        if len(view) <= step:
            await self._one(opcode, lba, view)
            return
        failure: list[BaseException] = []
        # Bound what one call keeps in flight: every command's timeout runs from its
        # submission, so a huge transfer queued whole behind a slow target would time out
        # commands that were merely waiting their turn.
        window = trio.Semaphore(_IO_WINDOW_PER_QUEUE * len(self.io))

        async def part(off: int) -> None:
            try:
                await self._one(opcode, lba + off // lbs, view[off:off + step])
            except NvmeError as e:
                if not failure:
                    failure.append(e)
                nursery.cancel_scope.cancel()
            finally:
                window.release()

        async with trio.open_nursery() as nursery:
            for off in range(0, len(view), step):
                await window.acquire()
                if failure:
                    window.release()
                    break
                nursery.start_soon(part, off)
        if failure:
            raise failure[0]

    async def read(self, lba: int, into: memoryview) -> None:
        """Fill ``into`` (a multiple of the LBA size) from ``lba`` on."""
        await self._io(P.IO_READ, lba, memoryview(into).cast("B"))

    async def write(self, lba: int, data) -> None:
        await self._io(P.IO_WRITE, lba, memoryview(data).cast("B"))

    async def flush(self) -> None:
        await self._pick().execute(P.sqe(P.IO_FLUSH, nsid=self.ns.nsid), what="Flush")
