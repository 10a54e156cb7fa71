"""kvfs's own FUSE transport: ``/dev/fuse`` read and answered by the daemon, no libfuse.

It exists for what pyfuse3 3.5 over libfuse 3.14 cannot negotiate (protocol 7.31, no INIT
flags past bit 31): **FUSE passthrough** (Linux 6.9+), where a sealed block opened for reading
is read by the kernel from its tier file without a request reaching the daemon
(kvfs/fs/passthrough.py decides which opens, docs/design.md "How a read travels").

The session mounts with mount(2) (root / CAP_SYS_ADMIN, as libfuse does for root), answers
INIT itself, and serves every request with the same handlers as the pyfuse3 transport
(:class:`kvfs.fs.ops.KvfsOperations`, a ``pyfuse3.Operations``): requests are decoded here
into the arguments pyfuse3 would pass (``pyfuse3.EntryAttributes``, a setattr-fields object, a
request context) and the handlers' answers (``EntryAttributes``, ``FileInfo``, ``FUSEError``)
encoded into the kernel's structures (kvfs/fs/wire.py). The worker loop is pyfuse3's shape
with kvfs's read lock and burst reader (kvfs/fs/loop.py): workers take turns reading one
request and run its handler; one is added whenever every worker is busy. With ``fuse_spin_us``
a worker that has answered looks for the next request for that long before anyone sleeps.

What it asks the kernel for is what pyfuse3 asks (wire.BASE_WANT, max_write 1 MiB), so both
transports give the same contract; passthrough is added where the kernel offers it and the
daemon may register backing files. Interrupts are ignored, as pyfuse3 ignores them.
"""
from __future__ import annotations

import errno
import logging
import os

import trio

from kvfs.fs import loop, wire
from kvfs.fs.mountdev import detach, mount_device
from kvfs.fs.handlers import Handlers

log = logging.getLogger(__name__)

MAX_WRITE = 1 << 20
BUFSIZE = MAX_WRITE + (64 << 10)         # a WRITE of MAX_WRITE bytes with its header and names
MAX_WORKERS = 64
NOTIFY_RESEND = 7              # FUSE_NOTIFY_RESEND (include/uapi/linux/fuse.h, protocol 7.40)


def unavailable() -> str | None:
    """Why this process cannot run the kernel transport (None: it can): it mounts with
    mount(2) and registers backing files, both CAP_SYS_ADMIN; the protocol must carry INIT's
    second flags word (Linux 5.17+, protocol 7.36)."""
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        caps = 0
    if not caps & (1 << 21):
        return "the daemon lacks CAP_SYS_ADMIN (not root)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    release = os.uname().release.split("-")[0].split(".")
    try:
        if tuple(int(x) for x in release[:2]) < (5, 17):
            return f"kernel {os.uname().release} predates FUSE protocol 7.36"
    except ValueError:
        pass
    return None


def _read_failed(e: OSError) -> int | None:
    """What a failed read of ``/dev/fuse`` means: None to try again (the request went to
    another reader, or was interrupted); 0 when the connection is gone."""
    if isinstance(e, BlockingIOError) or e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
        return None
    if e.errno == errno.ENODEV:          # unmounted, or the connection was aborted
        return 0
    raise e


async def _locked_read(lock, readv, fd: int, view) -> int | None:
    """One read of a request by the worker holding the read lock, which it then gives up."""
    try:
        return await readv(fd, view)
    except OSError as e:
        return _read_failed(e)
    finally:
        lock.release()


def resend(fd: int) -> str:
    """Ask the kernel to send again every request read on this connection and not answered
    (FUSE_NOTIFY_RESEND, Linux 6.9+): those a killed daemon had taken. Returns what happened,
    for the log and ``.kvfs/stats``: ``"sent"``, or why not (an older kernel answers EINVAL:
    the requests the dead daemon had read then wait until their callers are interrupted)."""
    try:
        os.write(fd, wire.OUT_HEADER.pack(wire.OUT_HEADER.size, NOTIFY_RESEND, 0))
    except OSError as e:
        why = f"unavailable ({os.strerror(e.errno)}: the kernel predates FUSE_NOTIFY_RESEND, Linux 6.9)"
        log.warning("FUSE_NOTIFY_RESEND %s; requests the dead daemon had read are not answered", why)
        return why
    return "sent"


class KernelSession:
    """One mount served over ``/dev/fuse`` (see the module's text)."""

    def __init__(self, ops, mountpoint: str, options: set[str], *, passthrough: bool = True,
                 writeback_cache: bool = False):
        self.ops = ops
        self.mountpoint = mountpoint
        self.options = set(options)
        self.fd = -1
        # the kernel takes passthrough or the writeback cache, never both (it drops passthrough)
        self.want_writeback = writeback_cache
        self.want_passthrough = passthrough and not writeback_cache
        self.handlers: Handlers | None = None
        self._cancel: trio.CancelScope | None = None
        self._ended = False
        self.workers = 0
        self._idle = 0
        self.requests = 0
        self.attached = False       # the session was mounted by the supervisor, not by us
        self.resend: str | None = None      # the answer to FUSE_NOTIFY_RESEND when attached
        self._draining = False
        self._reading: set = set()   # the cancel scopes of workers waiting for a request

    # ---- mount / unmount --------------------------------------------------------------
    def mount(self) -> None:
        """Open ``/dev/fuse`` and mount it at the mount point (the kernel then sends INIT)."""
        self.fd = mount_device(self.mountpoint, self.options)
        self.handlers = Handlers(self.ops, self.fd, self.want_passthrough, self.want_writeback)
        log.info("mounted %s with kvfs's own FUSE transport", self.mountpoint)

    def attach(self, fd: int, session: dict | None, epoch: int) -> None:
        """Serve a session another process mounted (kvfs/supervisor.py): ``fd`` is its
        ``/dev/fuse`` descriptor, ``session`` what INIT agreed on when a daemon before this one
        answered it (None: INIT is still to come), ``epoch`` this daemon's number in the
        mount's life, put into every file handle it gives the kernel. The kernel is then asked
        to send again what a dead daemon had read and not answered (FUSE_NOTIFY_RESEND)."""
        self.fd = fd
        self.attached = True
        self.handlers = Handlers(self.ops, self.fd, self.want_passthrough, self.want_writeback, epoch=epoch)
        if session is not None:
            self.handlers.session.restore(session)
            self.handlers.passthrough.forget_predecessors()
            self.resend = resend(fd)
        log.info("attached to %s (epoch %d, %s); FUSE protocol %s", self.mountpoint, epoch,
                 "INIT answered before" if session else "INIT to come",
                 self.negotiated_protocol())

    def drain(self) -> None:
        """End :meth:`serve` once the requests read so far are answered; what is not read
        stays queued in the kernel for the next daemon (``kvfs restart``)."""
        self._draining = True
        for scope in list(self._reading):
            scope.cancel()

    def close(self, unmount: bool = True) -> None:
        """Unmount (lazily, as libfuse does for root) and close the device. An attached
        session is never unmounted here: the supervisor holds the mount."""
        if self.handlers is not None:
            self.handlers.close(handover=self._draining)
        if unmount and self.fd >= 0 and not self.attached:
            detach(self.mountpoint)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def terminate(self) -> None:
        """End :meth:`serve` (from the trio thread, as ``pyfuse3.terminate``)."""
        self._ended = True
        if self._cancel is not None:
            self._cancel.cancel()

    # ---- the request loop --------------------------------------------------------------
    async def serve(self, reader: loop.Reader | None = None) -> None:
        """Serve requests until the mount goes away (ENODEV) or :meth:`terminate`."""
        self._reader = reader or loop.Reader()
        self._lock = loop.ReadLock()
        with trio.CancelScope() as self._cancel:
            if self._ended:
                return
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._spawn()
        log.debug("kernel transport: %d requests, %d workers", self.requests, self.workers)

    def _spawn(self) -> None:
        self.workers += 1
        self._idle += 1
        self._nursery.start_soon(self._worker, name=f"kvfs-fuse-{self.workers}")

    async def _worker(self) -> None:
        buf = bytearray(BUFSIZE)
        view = memoryview(buf)
        reader = self._reader
        fd, handle, lock, readv = self.fd, self.handlers.handle, self._lock, reader.readv
        answered = False        # this worker just answered a request
        while True:
            if self._draining:
                return
            with trio.CancelScope() as waiting:
                self._reading.add(waiting)
                n = None
                # the read lock without a coroutine when it is free (the usual case: one worker
                # reads at a time and a request's handler rarely waits)
                if lock.try_acquire():
                    n = await _locked_read(lock, readv, fd, view)
                elif answered and reader.spin_ns:
                    # our handler waited (a seal's thread, say) and another worker holds the read
                    # lock, asleep in trio's wait: the next request (the caller's, right after
                    # our answer) is looked for here, without the lock, for the spin's window
                    answered = False
                    try:
                        n = await reader.spin(fd, view)
                    except OSError as e:
                        n = _read_failed(e)
                else:
                    await lock.acquire()
                    n = await _locked_read(lock, readv, fd, view)
            self._reading.discard(waiting)
            if waiting.cancelled_caught:
                return          # drained while waiting for a request (none was read)
            answered = False
            if n is None:
                continue
            if n == 0:
                self._cancel.cancel()
                return
            self.requests += 1
            self._idle -= 1
            if self._idle == 0 and self.workers < MAX_WORKERS and not self._draining:
                self._spawn()
            try:
                await handle(view[:n])
            finally:
                self._idle += 1
            answered = True

    def statistics(self) -> dict:
        """What ``.kvfs/stats`` shows as ``transport``."""
        h = self.handlers
        out = {"name": "kernel", "requests": self.requests, "workers": self.workers,
               "protocol": self.negotiated_protocol()}
        if self.attached:
            out["resend"] = self.resend
            out["epoch"] = h.epoch if h is not None else None
            out["stale_handles"] = h.handles.stale_count if h is not None else 0
            out["readopened"] = h.files.readopened if h is not None else 0
        if h is not None:
            out["passthrough"] = dict(h.passthrough.statistics(), **self.ops.opens.statistics())
            out["writeback_cache"] = h.session.writeback
            out["by_opcode"] = h.requests()
            out["us_by_opcode"] = h.request_us()
            out["data_reads"] = self.ops.data_reads     # READs of files, not of .kvfs/ control files
        return out

    def negotiated_protocol(self) -> str | None:
        h = self.handlers
        return None if h is None or not h.minor else f"7.{h.minor}"

