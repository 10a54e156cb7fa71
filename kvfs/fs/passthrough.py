"""FUSE passthrough of sealed blocks: the kernel reads an open file from its tier file.

A read-only open of a sealed object whose copy is a file the daemon made (a RAM-tier file in
its 0700 tmpfs directory, an NVMe-tier object file; a lower-tier copy verified against its
checksums first, once per registration) is answered with ``FOPEN_PASSTHROUGH`` and a backing
id: ``read``, ``pread``, ``readv``, ``splice`` and ``mmap`` of that descriptor then go to the
tier file in the kernel, with no request to the daemon (docs/design.md, "How a read travels").

The kernel's rules, measured in issue 30's spike (benchmarks/passthrough_spike.py):
- one backing file per FUSE inode while any passthrough open of it lasts (another: EIO), so a
  registration is per inode and object, shared by that inode's passthrough opens;
- the inode lets its backing file go when its last passthrough file is released (before
  RELEASE is sent: ``fuse_inode_uncached_io_end``), while the id stays valid in the
  connection until BACKING_CLOSE: a later open of the inode may be answered with the same id
  (``fuse_passthrough_open`` looks the id up; each open gets its own file over the backing's
  path), and the inode may then be opened cached or given another id meanwhile;
- an inode is either in passthrough or in cached I/O mode: while a passthrough open lasts,
  every other open of it must be ``FOPEN_DIRECT_IO`` (a cached one fails with EIO), and a
  passthrough open is only given while the inode has no cached open
  (:meth:`KvfsOperations._file_info` applies both);
- registering needs CAP_SYS_ADMIN and a connection that negotiated passthrough.

The open keeps its handle in the store (the object's reference count), so eviction, demotion
and replacement never free the tier file under it, and the budgets count it, as for any open.

A registration whose last open went is kept *idle* for a while (at most ``IDLE_MAX`` of them,
none past ``IDLE_SECONDS`` after it was registered and its copy checked): a re-read of the same block then skips the file's open, check
(a full read and checksum of an NVMe copy) and registration. An idle one holds no reference
in the store and no inode in the kernel; it is reused only for the inode's current version,
the same object, whose registered copy is still its top copy (``Opens._pass``), and it is
closed before the store frees that copy or promotes the object (``copy_dropped``, the
store's ``on_copy_dropped``), so it never keeps a file the tier no longer counts.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
from collections import OrderedDict

import trio

from kvfs.fs import wire

log = logging.getLogger(__name__)

IDLE_MAX = 64           # idle registrations kept (the oldest closed first)
IDLE_SECONDS = 30.0     # an idle registration this long after its registration (its check) is closed


class _Registration:
    """One inode's backing file: the kernel's id for it, the object and the tier of the copy
    it is, its passthrough opens, and when it was registered (its copy checked)."""

    __slots__ = ("backing_id", "obj", "ino", "tier", "opens", "born", "moved", "adopted")

    def __init__(self, backing_id: int, obj, ino: int, tier: str | None):
        self.backing_id, self.obj, self.ino, self.tier = backing_id, obj, ino, tier
        self.opens, self.born = 0, trio.current_time()
        self.moved = False          # its copy was promoted past or is going: not kept idle
        self.adopted = False        # a dead daemon's, counted as one open until ADOPTED_S


SWEEP_DELAY_S = 10.0     # after a restart, a dead daemon's backing ids are closed this much later
ADOPTED_S = 60.0         # a dead daemon's registration in use is shared this long (see adopt)


class Passthrough:
    """The session's backing registrations (one per inode in passthrough)."""

    def __init__(self, dev_fd: int, wanted: bool):
        self.dev = dev_fd
        self.wanted = wanted
        self.enabled = False
        self.why = "off (the kernel has not sent INIT yet)" if wanted else "off (turned off: passthrough = false)"
        self._by_ino: dict[int, _Registration] = {}     # inodes in passthrough now
        self._idle: OrderedDict[int, _Registration] = OrderedDict()     # ino -> kept, oldest first
        self._fh: dict[int, int] = {}             # passthrough fh -> ino
        self._answer: dict[int, int] = {}         # fh -> backing id, until OPEN's reply is sent
        self._unheld: dict[int, trio.Event] = {}  # inode -> set when its registration ends
        self.opens = self.registered = self.refused = self.declined = self.busy = 0
        self.reused = self.idle_closed = 0
        self._expiry = float("inf")               # when the oldest idle registration expires
        self.failed: str | None = None
        # a daemon that replaced a dead one on the same session (kvfs/supervisor.py): the dead
        # one's backing ids stay registered on the connection, pinning their tier files
        self._sweep_predecessors = False
        self.predecessor_ids_closed = 0
        self.journal = None         # called with each registration and closure (a supervisor's)
        self._adopted: set[int] = set()           # backing ids taken over from a dead daemon
        self._adopted_until = float("inf")
        self.adopted = 0

    def adopt(self, entries: list, find_object) -> None:
        """The registrations a dead daemon of this session had (its journal, kept by the
        supervisor): the kernel holds an inode opened in passthrough to the backing file of
        that open, and fails (EIO) an open of it that names another backing file, even one of
        the same file. So each is taken as in use by one open for ``ADOPTED_S`` (the old
        descriptors, unknown here), and opens of its inode and version share it meanwhile. One
        whose object or copy is gone is left to the sweep."""
        now = trio.current_time()
        for e in entries:
            obj = find_object(e.get("oid"))
            ino, tier = e.get("ino"), e.get("tier")
            if obj is None or ino in self._by_ino or (tier is not None and tier not in obj.place):
                continue
            reg = self._by_ino[ino] = _Registration(int(e["id"]), obj, ino, tier)
            reg.opens, reg.adopted = 1, True
            self._adopted.add(reg.backing_id)
            self.adopted += 1
        if self._adopted:
            self._adopted_until = now + ADOPTED_S
            log.info("took over %d backing registrations of a dead daemon", len(self._adopted))

    def _unadopt(self) -> None:
        """``ADOPTED_S`` after the takeover: the dead daemon's opens no longer count."""
        self._adopted_until = float("inf")
        for reg in [r for r in self._by_ino.values() if r.adopted]:
            reg.adopted = False
            reg.opens -= 1
            if not reg.opens:
                del self._by_ino[reg.ino]
                self._end(reg)

    def _note(self, msg: dict) -> None:
        if self.journal is not None:
            try:
                self.journal(msg)
            except Exception:       # noqa: BLE001 - a journal note never fails an open
                log.exception("backing journal note failed")

    def forget_predecessors(self) -> None:
        """Close the backing ids a dead daemon of this session left registered, ``SWEEP_DELAY_S``
        after this one has its first: the kernel numbers them cyclically upwards, so every id
        below our first is a predecessor's. An open file keeps its own reference to its backing
        file: closing its id only stops pinning the tier file past that file's close."""
        self._sweep_predecessors = True

    def _sweep(self, below: int) -> None:
        closed = 0
        adopted = set(self._adopted)
        for backing_id in range(1, below):
            if backing_id in adopted:
                continue
            try:
                fcntl.ioctl(self.dev, wire.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)))
                closed += 1
                self._note({"op": "unbacking", "id": backing_id})
            except OSError:
                pass                # not registered (closed already), or the session ended
        self.predecessor_ids_closed = closed
        log.info("closed %d backing ids a dead daemon had left registered (below %d)", closed, below)

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

    def kept(self, ino: int):
        """``ino``'s idle registration (its ``obj`` and ``tier``), or None."""
        reg = self._idle.get(ino)
        if reg is not None and trio.current_time() - reg.born >= IDLE_SECONDS:
            del self._idle[ino]
            self._close_idle(reg)
            return None
        return reg

    def offer(self, fh: int, ino: int, obj, backing_fd, tier: str | None = None) -> bool:
        """Register ``backing_fd`` (a descriptor of ``obj``'s copy on ``tier``, closed here:
        the kernel holds the file by its id) for ``ino`` unless it already has ``obj``'s, in
        use or idle (then ``backing_fd`` may be None: the caller checked that the idle one may
        serve, :meth:`kept`); remember the answer for ``fh``'s OPEN reply."""
        if trio.current_time() >= self._adopted_until:
            self._unadopt()
        reg = self._by_ino.get(ino)
        if reg is None and backing_fd is None:
            reg = self._idle.pop(ino, None)
            if reg is None or not (reg.obj is obj or reg.obj.oid == obj.oid):
                if reg is not None:
                    self._close_idle(reg)
                return False
            self._by_ino[ino] = reg
            self.reused += 1
        elif reg is None:
            idle = self._idle.pop(ino, None)
            if idle is not None:
                self._close_idle(idle)       # a new copy or version replaces it
            try:
                backing_id = fcntl.ioctl(self.dev, wire.DEV_IOC_BACKING_OPEN,
                                         bytearray(wire.BACKING_MAP.pack(backing_fd, 0, 0)))
            except OSError as e:
                self._refused(e)
                return False
            finally:
                os.close(backing_fd)         # the kernel holds the file by the id
            reg = self._by_ino[ino] = _Registration(backing_id, obj, ino, tier)
            self.registered += 1
            self._note({"op": "backing", "id": backing_id, "ino": ino, "oid": obj.oid, "tier": tier})
            if self._sweep_predecessors:
                self._sweep_predecessors = False
                # not at once: an OPEN the dead daemon answered with one of its ids just before
                # it died has its backing looked up by the opener after the answer (in the
                # opener's own time, fuse_file_io_open); an id closed before that fails the
                # open with EIO (seen: 1-2 opens in 100 kills under load)
                t = threading.Timer(SWEEP_DELAY_S, self._sweep, args=(backing_id,))
                t.name, t.daemon = "kvfs-backing-sweep", True
                t.start()
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
        """RELEASE of ``fh``: with the inode's last passthrough open its registration is kept
        idle (its object still live, that copy still placed: any later move of it goes through
        :meth:`copy_dropped`), else closed."""
        self._answer.pop(fh, None)
        if self._adopted_until != float("inf") and trio.current_time() >= self._adopted_until:
            self._unadopt()
        ino = self._fh.pop(fh, None)
        if ino is None:
            return
        reg = self._by_ino[ino]
        reg.opens -= 1
        if reg.opens:
            return
        del self._by_ino[ino]
        obj = reg.obj
        if IDLE_MAX and not reg.moved and not obj.dead and not obj.corrupt and reg.tier in obj.place:
            self._idle[ino] = reg
            self._expiry = min(self._expiry, reg.born + IDLE_SECONDS)
            self._trim()
            self._unhold(ino)
        else:
            self._end(reg)

    def copy_dropped(self, oid: int) -> None:
        """The store is about to free a copy of object ``oid`` or to promote it: its idle
        registrations go now (in use ones hold the object: the store keeps their copy, and
        they are closed, not kept idle, at their last RELEASE)."""
        for reg in self._by_ino.values():
            if reg.obj.oid == oid:
                reg.moved = True
        for reg in [r for r in self._idle.values() if r.obj.oid == oid]:
            del self._idle[reg.ino]
            self._close_idle(reg)

    def _trim(self) -> None:
        """Close the idle registrations past ``IDLE_SECONDS`` since they were registered,
        then the oldest idle ones past ``IDLE_MAX``."""
        now = trio.current_time()
        if now >= self._expiry:
            for reg in [r for r in self._idle.values() if now - r.born >= IDLE_SECONDS]:
                del self._idle[reg.ino]
                self._close_idle(reg)
            self._expiry = min((r.born for r in self._idle.values()), default=float("inf")) + IDLE_SECONDS
        while len(self._idle) > IDLE_MAX:
            reg = self._idle.popitem(last=False)[1]
            self._close_idle(reg)

    def _close_idle(self, reg: "_Registration") -> None:
        self.idle_closed += 1
        self._close_id(reg.backing_id)

    def _end(self, reg: "_Registration") -> None:
        self._close_id(reg.backing_id)
        self._unhold(reg.ino)

    def _unhold(self, ino: int) -> None:
        gone = self._unheld.pop(ino, None)
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
        self._adopted.discard(backing_id)
        self._note({"op": "unbacking", "id": backing_id})
        try:
            fcntl.ioctl(self.dev, wire.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)))
        except OSError as e:
            log.debug("closing backing id %d: %s", backing_id, e)

    def close(self, keep_in_use: bool = False) -> None:
        """At the session's end: every registration closed; ``keep_in_use`` (a handover to
        the next daemon): those in use stay registered, for it to take over (:meth:`adopt`)."""
        for reg in self._by_ino.values():
            if not keep_in_use:
                self._end(reg)
        for reg in self._idle.values():
            self._close_id(reg.backing_id)
        self._by_ino.clear()
        self._idle.clear()
        self._fh.clear()

    def statistics(self) -> dict:
        self._trim()
        return {"state": self.why, "opens": self.opens, "registered": self.registered,
                "reused": self.reused, "held": len(self._by_ino), "idle": len(self._idle),
                "idle_closed": self.idle_closed, "open_now": len(self._fh), "refused": self.refused,
                "declined": self.declined, "busy": self.busy, "last_error": self.failed,
                "predecessor_ids_closed": self.predecessor_ids_closed, "adopted": self.adopted}
