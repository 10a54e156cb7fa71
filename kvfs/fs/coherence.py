"""What the kernel caches of kvfs (names, attributes, pages) kept true while a session is
mounted: the daemon's own changes become kernel invalidations (kvfs/fs/notifier.py)."""
from __future__ import annotations

import errno

import pyfuse3
import trio

from kvfs.fs import notifyproc
from kvfs.fs.notifier import Notifier
from kvfs.fs.opens import EMPTY, Opens, Renewed

INVALIDATE_WAIT = 10.0     # seconds a commit waits for its names' kernel invalidations


class KernelCaches:
    """The kernel's caches of the mount: ``opens`` (kvfs/fs/opens.py) knows what the page
    cache holds of each inode; notifications go only while a session exists (between
    :meth:`start` and :meth:`stop`)."""

    def __init__(self, opens: Opens):
        self.opens = opens
        self.notifier = Notifier()
        self._mounted = False         # kernel notifications only while a session exists

    @property
    def mounted(self) -> bool:
        return self._mounted

    def start(self, direct=None) -> None:
        """After ``pyfuse3.init`` or the kernel transport's mount: notifications start (through
        ``direct``, the session's device, when the transport gives one)."""
        self._mounted = True
        self.notifier.start(notifyproc.open_channel(), direct)

    def stop(self) -> None:
        """Before ``pyfuse3.close`` or the unmount: no notification may reach a destroyed session."""
        self._mounted = False
        self.notifier.stop()

    async def invalidate_names(self, names: list[tuple[int, bytes]]) -> None:
        """Names the daemon added itself (``.kvfs/commit``): the kernel may hold a negative or
        an old entry for them. Sent from a worker thread and waited for (the commit's answer
        must not race them), while this loop keeps serving requests that hold the locks."""
        if not self._mounted or not names:
            return

        def send() -> None:
            for parent, name in names:
                try:
                    self.notifier.deliver(pyfuse3.invalidate_entry, parent, name)
                except OSError:             # ENOENT: the kernel has no entry for it
                    pass
        with trio.move_on_after(INVALIDATE_WAIT):
            await trio.to_thread.run_sync(send, abandon_on_cancel=True)

    async def synced(self) -> None:
        """Names the store removed on its own so far are out of the kernel's caches (the
        invalidations queued for them delivered; bounded by INVALIDATE_WAIT)."""
        if self._mounted:
            await self.notifier.drained(INVALIDATE_WAIT)

    # Names the store removed on its own (eviction, corruption). Names the kernel removed
    # (unlink, rename over a name) are never notified: the kernel already knows, and a
    # notification would wait on the directory lock that request holds.
    def name_removed(self, parent: int, name: bytes, ino: int) -> None:
        if self._mounted:
            self.notifier.send(pyfuse3.invalidate_entry, parent, name, ino)

    def renewed(self, r: Renewed) -> pyfuse3.FUSEError:
        """A change by a name that found its file held and renewed (kvfs/fs/opens.py): the
        kernel's entry for the name goes (other processes then look up the new inode), and
        the change is answered ESTALE, which the kernel retries once after a new lookup."""
        if r.entry is not None and self._mounted:
            self.notifier.send(pyfuse3.invalidate_entry, *r.entry)
        return pyfuse3.FUSEError(errno.ESTALE)

    def content_changed(self, ino: int) -> None:
        """The store's ``on_content_changed`` (wired by kvfs.build.build_ops)."""
        self.opens.page_key.pop(ino, None)
        if self._mounted:
            self.notifier.send(pyfuse3.invalidate_inode, ino, False)

    def sealed(self, ino: int, serial: int, oid: int) -> None:
        """The store's ``on_sealed`` (wired by kvfs.build.build_ops): a write state became
        object ``oid``. Its writes all went through the kernel's page cache (no O_DIRECT, no
        direct_io handle, no O_APPEND) when the pages still carry its key: then they hold
        exactly the sealed bytes, and the size and mtime the kernel knows are the sealed ones
        (see WriteState.mtime), so pages and attributes stay; else both go. A new file written
        only by direct_io handles (write-only opens with passthrough on) has no page to drop,
        and the kernel took its size and mtime from those writes as from cached ones: nothing
        is notified either."""
        key = self.opens.page_key.get(ino)
        if key == ("ws", serial):
            self.opens.page_key[ino] = ("obj", oid)
            return
        if key == EMPTY:
            del self.opens.page_key[ino]
            return
        self.content_changed(ino)
