"""FUSE passthrough of sealed blocks: the kernel reads an open file from its tier file.

A read-only open of a sealed object whose copy is a file the daemon made (a RAM-tier file in
its 0700 tmpfs directory, an NVMe-tier object file; a lower-tier copy verified against its
checksums first, once per registration) is answered with ``FOPEN_PASSTHROUGH`` and a backing
id: ``read``, ``pread``, ``readv``, ``splice`` and ``mmap`` of that descriptor then go to the
tier file in the kernel, with no request to the daemon (docs/design.md, "How a read travels").

The kernel's rules, measured in issue 30's spike (benchmarks/passthrough_spike.py):
- one backing file per FUSE inode while any passthrough open of it lasts (another: EIO), so a
  registration is per inode and object, shared by that inode's passthrough opens, and closed
  at the last one's RELEASE (which comes after the last mapping went);
- an inode is either in passthrough or in cached I/O mode: while a passthrough open lasts,
  every other open of it must be ``FOPEN_DIRECT_IO`` (a cached one fails with EIO), and a
  passthrough open is only given while the inode has no cached open
  (:meth:`KvfsOperations._file_info` applies both);
- registering needs CAP_SYS_ADMIN and a connection that negotiated passthrough.

The open keeps its handle in the store (the object's reference count), so eviction, demotion
and replacement never free the tier file under it, and the budgets count it, as for any open.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct

import trio

from kvfs.fs import wire

log = logging.getLogger(__name__)


class _Registration:
    """One inode's backing file: the kernel's id for it, the object, its passthrough opens."""

    __slots__ = ("backing_id", "obj", "ino", "opens")

    def __init__(self, backing_id: int, obj, ino: int):
        self.backing_id, self.obj, self.ino, self.opens = backing_id, obj, ino, 0


class Passthrough:
    """The session's backing registrations (one per inode in passthrough)."""

    def __init__(self, dev_fd: int, wanted: bool):
        self.dev = dev_fd
        self.wanted = wanted
        self.enabled = False
        self.why = "off (the kernel has not sent INIT yet)" if wanted else "off (turned off: passthrough = false)"
        self._by_ino: dict[int, list] = {}        # ino -> [backing id, oid, opens]
        self._fh: dict[int, int] = {}             # passthrough fh -> ino
        self._answer: dict[int, int] = {}         # fh -> backing id, until OPEN's reply is sent
        self._unheld: dict[int, trio.Event] = {}  # inode -> set when its registration ends
        self.opens = self.registered = self.refused = self.declined = self.busy = 0
        self.failed: str | None = None

    def negotiated(self, got: bool, offered: int) -> None:
        if not self.wanted:
            return
        self.enabled = got
        if got:
            self.why = "on"
        elif not offered & wire.PASSTHROUGH:
            self.why = "off (the kernel does not offer FUSE passthrough: Linux 6.9+ needed)"
        else:
            self.why = "off (not negotiated)"

    def state(self) -> str:
        return self.why

    # ---- the open path ---------------------------------------------------------------------
    def mode(self, ino: int):
        """The object whose backing file ``ino`` is registered with (None: not in passthrough)."""
        reg = self._by_ino.get(ino)
        return None if reg is None else reg.obj

    def offer(self, fh: int, ino: int, obj, backing_fd) -> bool:
        """Register ``backing_fd`` (a descriptor of ``obj``'s tier file, closed here: the
        kernel holds the file by its id) for ``ino`` unless it already has ``obj``'s (then
        ``backing_fd`` may be None); remember the answer for ``fh``'s OPEN reply."""
        reg = self._by_ino.get(ino)
        if reg is None:
            if backing_fd is None:
                return False
            try:
                backing_id = fcntl.ioctl(self.dev, wire.DEV_IOC_BACKING_OPEN,
                                         bytearray(wire.BACKING_MAP.pack(backing_fd, 0, 0)))
            except OSError as e:
                self._refused(e)
                return False
            finally:
                os.close(backing_fd)         # the kernel holds the file by the id
            reg = self._by_ino[ino] = _Registration(backing_id, obj, ino)
            self.registered += 1
        else:
            if backing_fd is not None:
                os.close(backing_fd)
            if reg.obj is not obj and reg.obj.oid != obj.oid:
                return False
        reg.opens += 1
        self._fh[fh] = ino
        self._answer[fh] = reg.backing_id
        self.opens += 1
        return True

    def _refused(self, e: OSError) -> None:
        self.refused += 1
        if self.failed is None:
            log.warning("FUSE passthrough: the kernel refused a backing file (%s); "
                        "those opens are served by the daemon", os.strerror(e.errno))
        self.failed = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"
        if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTTY):
            self.enabled = False
            self.why = f"off (backing registration refused: {self.failed})"

    def answer(self, fh: int) -> tuple[int, int] | None:
        """(backing id, open flags) for the OPEN reply of ``fh`` when it was offered."""
        backing_id = self._answer.pop(fh, None)
        if backing_id is None:
            return None
        return backing_id, wire.FOPEN_PASSTHROUGH | wire.FOPEN_NOFLUSH

    def holds(self, fh: int) -> bool:
        return fh in self._fh

    def release(self, fh: int) -> None:
        """RELEASE of ``fh``: the inode's registration goes with its last passthrough open."""
        self._answer.pop(fh, None)
        ino = self._fh.pop(fh, None)
        if ino is None:
            return
        reg = self._by_ino[ino]
        reg.opens -= 1
        if reg.opens == 0:
            del self._by_ino[ino]
            self._end(reg)

    def _end(self, reg: "_Registration") -> None:
        self._close_id(reg.backing_id)
        gone = self._unheld.pop(reg.ino, None)
        if gone is not None:
            gone.set()

    async def unheld(self, ino: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until no passthrough open holds ``ino``: the kernel
        drops a file's backing before it sends RELEASE, so a close just made may not have
        reached the daemon yet. False if one still holds it."""
        if ino not in self._by_ino:
            return True
        gone = self._unheld.setdefault(ino, trio.Event())
        with trio.move_on_after(timeout):
            await gone.wait()
        return ino not in self._by_ino

    def _close_id(self, backing_id: int) -> None:
        try:
            fcntl.ioctl(self.dev, wire.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)))
        except OSError as e:
            log.debug("closing backing id %d: %s", backing_id, e)

    def close(self) -> None:
        for reg in self._by_ino.values():
            self._end(reg)
        self._by_ino.clear()
        self._fh.clear()

    def statistics(self) -> dict:
        return {"state": self.why, "opens": self.opens, "registered": self.registered,
                "held": len(self._by_ino), "open_now": len(self._fh), "refused": self.refused,
                "declined": self.declined, "busy": self.busy, "last_error": self.failed}
