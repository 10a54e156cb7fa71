"""A raw volume of fixed-size blocks, reached natively over NVMe/TCP or as a local block device/file.

``Volume`` is what the object store (kvfs.remote.tier) sees: byte-addressed reads
and writes in whole logical blocks, flush, and availability. ``NvmeTcpVolume``
wraps the userspace initiator and owns reconnection: a transport error marks it
down at once (every call then raises TierUnavailable without waiting) and
``serve`` reconnects with exponential backoff and sends Keep Alive at half the
negotiated KATO.
"""
from __future__ import annotations

import abc
import logging
import random
from typing import Awaitable, Callable

import trio

from kvfs.errors import TierUnavailable
from kvfs.remote.controller import Controller
from kvfs.remote.errors import NvmeError, NvmeStatusError, TransportError
from kvfs.remote.identify import version_str
from kvfs.remote.url import RemoteUrl

log = logging.getLogger(__name__)


class Volume(abc.ABC):
    block_size: int = 512
    size: int = 0                       # bytes
    describe: str = ""

    def __init__(self) -> None:
        self.errors = 0
        self.reconnects = 0
        self.last_error = ""
        self._written = 0               # write generations, for group-commit flushes
        self._flushed = 0
        self._flush_lock = trio.Lock()

    @property
    def available(self) -> bool:
        return True

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect/open. Raises TierUnavailable when the volume cannot be reached."""

    async def close(self) -> None:
        pass

    async def serve(self, on_reconnect: Callable[[], Awaitable[None]] | None = None) -> None:
        await trio.sleep_forever()

    def buffer(self, size: int):
        """A zeroed buffer suitable for ``write`` (page-aligned where O_DIRECT needs it)."""
        return bytearray(size)

    @abc.abstractmethod
    async def read(self, offset: int, length: int) -> memoryview:
        """Return ``length`` bytes at ``offset`` (both multiples of block_size)."""

    @abc.abstractmethod
    async def _write(self, offset: int, data: memoryview) -> None: ...

    @abc.abstractmethod
    async def _flush(self) -> None: ...

    async def write(self, offset: int, data) -> int:
        """Write whole blocks; return a write generation to pass to ``durable``."""
        await self._write(offset, memoryview(data).cast("B"))
        self._written += 1
        return self._written

    async def durable(self, generation: int) -> None:
        """Make every write up to ``generation`` durable; concurrent callers share one flush."""
        async with self._flush_lock:
            if self._flushed >= generation:
                return
            upto = self._written
            await self._flush()
            self._flushed = max(self._flushed, upto)

    def status(self) -> dict:
        return {"transport": self.describe, "available": self.available, "errors": self.errors,
                "reconnects": self.reconnects, "last_error": self.last_error}

    def identity(self) -> dict:
        return {"transport": self.describe, "block_size": self.block_size, "size": self.size}


class NvmeTcpVolume(Volume):
    describe = "nvme-tcp"

    def __init__(self, url: RemoteUrl):
        super().__init__()
        self.url = url
        self.ctrl: Controller | None = None
        self._down = trio.Event()           # set when the connection is lost
        self.backoff_min, self.backoff_max = 0.2, 5.0

    @property
    def available(self) -> bool:
        return self.ctrl is not None

    async def _connect(self) -> None:
        ctrl = await Controller.connect(self.url)
        ns = ctrl.ns
        if self.size and (ns.lba_size != self.block_size or ns.size != self.size):
            ctrl.close()
            raise TransportError(f"namespace changed: now {ns.nsze} x {ns.lba_size} B, was "
                                 f"{self.size // self.block_size} x {self.block_size} B")
        self.block_size, self.size = ns.lba_size, ns.size
        self.ctrl = ctrl
        self._down = trio.Event()

    async def open(self) -> None:
        try:
            await self._connect()
        except NvmeError as e:
            self._lost(e)
            raise TierUnavailable(f"remote {self.url}: {e}") from e

    async def close(self) -> None:
        ctrl, self.ctrl = self.ctrl, None
        if ctrl is not None:
            await ctrl.shutdown()

    def _lost(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = str(exc)
        if self.ctrl is not None:
            log.warning("remote %s lost: %s", self.url, exc)
            self.ctrl.close()
            self.ctrl = None
        self._down.set()

    def _ctrl(self) -> Controller:
        ctrl = self.ctrl
        if ctrl is None:
            raise TierUnavailable(f"remote {self.url} is disconnected ({self.last_error or 'not connected'})")
        return ctrl

    async def _guard(self, op, *args):
        ctrl = self._ctrl()
        try:
            return await op(ctrl, *args)
        except TransportError as e:
            if self.ctrl is ctrl:
                self._lost(e)
            raise TierUnavailable(f"remote {self.url}: {e}") from e
        except NvmeStatusError as e:
            self.errors += 1
            self.last_error = str(e)
            # namespace gone or not ready (invalid namespace, namespace not ready, invalid
            # field), or a path error (a disabled namespace on newer targets): drop the
            # connection; reconnecting re-identifies the namespace and checks the volume
            if (e.sct == 0 and e.sc in (0x0B, 0x82, 0x0A)) or e.sct == 3:
                if self.ctrl is ctrl:
                    self._lost(e)
            raise TierUnavailable(f"remote {self.url}: {e}") from e

    async def read(self, offset: int, length: int) -> memoryview:
        buf = bytearray(length)

        async def op(ctrl: Controller) -> None:
            await ctrl.read(offset // ctrl.ns.lba_size, memoryview(buf))
        await self._guard(op)
        return memoryview(buf)

    async def _write(self, offset: int, data: memoryview) -> None:
        async def op(ctrl: Controller) -> None:
            await ctrl.write(offset // ctrl.ns.lba_size, data)
        await self._guard(op)

    async def _flush(self) -> None:
        async def op(ctrl: Controller) -> None:
            await ctrl.flush()
        await self._guard(op)

    async def serve(self, on_reconnect: Callable[[], Awaitable[None]] | None = None) -> None:
        """Keep alive while connected; reconnect with backoff while not. Runs until cancelled."""
        delay = self.backoff_min
        while True:
            ctrl = self.ctrl
            if ctrl is not None:
                interval = self.url.kato / 2 if self.url.kato else None
                with trio.move_on_after(interval if interval else float("inf")):
                    await self._down.wait()
                if self.ctrl is ctrl and interval:
                    try:
                        await ctrl.keep_alive()
                    except NvmeError as e:
                        if self.ctrl is ctrl:
                            self._lost(e)
                continue
            try:
                await self._connect()
                self.reconnects += 1
                log.info("remote %s reconnected", self.url)
                if on_reconnect is not None:
                    await on_reconnect()
            except (TierUnavailable, NvmeError) as e:
                if self.ctrl is not None:       # connected, but the volume is not usable
                    self._lost(e)
                self.last_error = str(e)
                log.debug("reconnect to %s failed: %s (next try in %.1f s)", self.url, e, delay)
                await trio.sleep(delay * random.uniform(0.8, 1.2))   # backoff between attempts
                delay = min(delay * 2, self.backoff_max)
                continue
            delay = self.backoff_min

    def status(self) -> dict:
        st = super().status()
        st.update({"url": str(self.url), "queues": self.url.queues, "depth": self.url.depth,
                   "digests": ",".join(d for d, on in (("header", self.url.hdgst), ("data", self.url.ddgst)) if on)
                   or "none"})
        if self.ctrl is not None:
            st.update(self.ctrl.statistics())
        return st

    def identity(self) -> dict:
        c = self.ctrl
        d = super().identity()
        if c is None:
            return d
        i, ns = c.ident, c.ns
        d.update({"url": str(self.url), "subnqn": i.subnqn, "hostnqn": self.url.hostnqn, "cntlid": c.cntlid,
                  "model": i.model, "serial": i.serial, "firmware": i.firmware, "nvme_version": version_str(c.vs),
                  "vid": f"{i.vid:#06x}", "mdts": i.mdts, "max_transfer": c.max_xfer, "ioccsz": i.ioccsz,
                  "maxcmd": i.maxcmd, "kas_ms": i.kas * 100, "cap": f"{c.cap.raw:#018x}", "mqes": c.cap.mqes,
                  "io_queues": len(c.io), "queue_depth": c.io[0].depth if c.io else 0,
                  "maxh2cdata": c.admin.maxh2cdata, "header_digest": c.admin.hdgst, "data_digest": c.admin.ddgst,
                  "oncs": f"{i.oncs:#06x}", "compare_and_write": i.compare_and_write,
                  "reservations": i.reservations,
                  "nsid": ns.nsid, "nsze": ns.nsze, "lba_size": ns.lba_size, "nguid": ns.nguid, "eui64": ns.eui64})
        return d
