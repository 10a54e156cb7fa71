"""Kernel cache invalidations, sent one at a time by a thread of the daemon (through the
helper process of kvfs/fs/notifyproc.py when there is one)."""
from __future__ import annotations

import logging
import os
import queue
import threading

import pyfuse3
import trio

from kvfs.fs import notifyproc

log = logging.getLogger(__name__)


class Notifier:
    """Kernel cache invalidations, sent one at a time by a thread of ours.

    A notification can block in the kernel on a directory or page lock that a request in
    flight holds, so none is ever sent by (or waited for by) a handler: they queue here
    (bounded; a full queue drops the notification and the kernel's timeouts take over).
    Only changes the kernel did not make itself are notified (eviction, checksum loss, a
    new sealed version). ``stop`` runs before the session is destroyed.
    """

    def __init__(self, maxsize: int = 4096):
        self._q: queue.Queue = queue.Queue(maxsize)
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.channel: notifyproc.Channel | None = None      # the helper process (kvfs.fs.notifyproc)
        self.direct = None          # writes a message on the session's device (kernel transport)

    def start(self, channel: "notifyproc.Channel | None" = None, direct=None) -> None:
        if self._thread is None:
            self.channel = channel
            self.direct = direct
            self._thread = threading.Thread(target=self._run, name="kvfs-notify", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        t, self._thread = self._thread, None
        if t is None:
            return
        while True:                       # make room for the sentinel
            try:
                self._q.put_nowait(None)
                break
            except queue.Full:
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    pass
        t.join(timeout)
        if t.is_alive():
            log.warning("kernel notification thread did not stop within %.0fs", timeout)
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close(timeout)

    def deliver(self, fn, *args) -> None:
        """Send one invalidation now (``pyfuse3.invalidate_entry`` / ``invalidate_inode`` and
        their arguments) through the helper process when there is one; OSError as pyfuse3's."""
        channel = self.channel
        kernel = fn in (pyfuse3.invalidate_entry, pyfuse3.invalidate_inode)
        if kernel and (channel is not None or self.direct is not None):
            msg = notifyproc.inval_entry(*args) if fn is pyfuse3.invalidate_entry else notifyproc.inval_inode(*args)
        if kernel and channel is not None:
            try:
                err = channel.send(msg)
            except (OSError, ValueError) as e:
                log.error("notification helper failed (%s): notifying from the daemon from now on", e)
                self.channel = None
                channel.abandon()
            else:
                if err:
                    raise OSError(err, os.strerror(err))
                return
        if kernel and self.direct is not None:
            self.direct(msg)         # kvfs's own transport: its device (no libfuse session)
            return
        fn(*args)

    def send(self, fn, *args) -> None:
        if self._thread is None:
            return
        try:
            self._q.put_nowait((fn, args))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("kernel notification queue full: %d notifications dropped", self.dropped)

    async def drained(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s, in a worker thread) until every notification queued so
        far reached the kernel; False if it did not in time (or the queue is full)."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._q.put_nowait((done.set, ()))
        except queue.Full:
            return False
        return await trio.to_thread.run_sync(done.wait, timeout, abandon_on_cancel=True)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            try:
                self.deliver(fn, *args)
            except OSError as e:          # ENOENT: the kernel did not cache it
                log.debug("%s%s: %s", fn.__name__, args, e)
            except Exception:             # noqa: BLE001 - a notification never kills the thread
                log.exception("%s%s failed", fn.__name__, args)
