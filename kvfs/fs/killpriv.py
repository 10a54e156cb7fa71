"""Clearing setuid/setgid bits as a local filesystem does (issue 40, item 5).

Linux clears S_ISUID on a write or truncate by a caller without CAP_FSETID and on every chown
of a regular file; S_ISGID with it when group-exec is set, or when the caller is neither in
the file's group nor has CAP_FSETID (a setgid file without group-exec is a mandatory-locking
marker, kept for its group). A FUSE filesystem that asks for ``HANDLE_KILLPRIV`` takes that
job from the kernel, and kvfs must ask: libfuse (the pyfuse3 transport) asks for it by default
and pyfuse3 cannot turn it off, and without it the kernel loses the bits' clearing on an
``open(O_TRUNC)`` (with ATOMIC_O_TRUNC the truncate is the OPEN's, the kernel sends no
SETATTR) and clears setgid only with group-exec (an older rule than its own).

Two contracts, one rule (:func:`kept_mode`):

* **v2** (kvfs's own transport, protocol 7.33+): the kernel says when -- ``FUSE_WRITE_KILL_SUIDGID``
  on a WRITE and ``FUSE_OPEN_KILL_SUIDGID`` on an OPEN with O_TRUNC (the caller lacks
  CAP_FSETID), ``FATTR_KILL_SUIDGID`` on a SETATTR (a truncate by such a caller; every chown).
* **v1** (pyfuse3 over libfuse): the kernel says nothing; the daemon kills on every write,
  truncate and chown, and decides CAP_FSETID itself from the caller's ``/proc/PID/status``
  (a write: the process that opened the descriptor; pyfuse3 gives write no caller).

A file without either bit costs one test of its cached mode. The caller's groups and
capabilities are read from /proc only when a setgid file without group-exec needs them.
"""
from __future__ import annotations

import os
import stat

from kvfs.errors import NamespaceError

CAP_FSETID = 4
SUIDGID = stat.S_ISUID | stat.S_ISGID


def _status(pid: int) -> tuple[frozenset, int | None]:
    """(supplementary groups, effective capabilities) of a live process; (empty, None) when it
    is gone or unreadable."""
    groups: frozenset = frozenset()
    caps = None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups = frozenset(int(g) for g in line.split()[1:])
                elif line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return groups, caps


class Killer:
    """The caller of a change that takes setuid/setgid away: a FUSE request's uid, gid and
    pid, its groups and CAP_FSETID read from /proc when first needed. ``capable``: known
    already (v2's flags say the caller lacks CAP_FSETID)."""

    __slots__ = ("uid", "gid", "pid", "_groups", "_capable")

    def __init__(self, uid: int, gid: int, pid: int, capable: bool | None = None):
        self.uid, self.gid, self.pid = uid, gid, pid
        self._groups: frozenset | None = None
        self._capable = capable

    @classmethod
    def of(cls, ctx, capable: bool | None = None) -> "Killer":
        return cls(ctx.uid, ctx.gid, ctx.pid, capable)

    def _read(self) -> None:
        groups, caps = _status(self.pid)
        self._groups = groups
        if self._capable is None:
            # a process gone before we asked: root is taken as capable, others not
            self._capable = self.uid == 0 if caps is None else bool(caps >> CAP_FSETID & 1)

    def capable(self) -> bool:
        """The caller has CAP_FSETID."""
        if self._capable is None:
            self._read()
        return bool(self._capable)

    def in_group(self, gid: int) -> bool:
        if gid == self.gid:
            return True
        if self._groups is None:
            self._read()
        return gid in self._groups

    def kept_mode(self, mode: int, gid: int) -> int:
        """A chown's: :func:`kept_mode` for this caller."""
        return kept_mode(mode, gid, self)

    def write_kept(self, mode: int, gid: int) -> int:
        """A write's or a truncate's: the mode unchanged for a caller with CAP_FSETID."""
        if not mode & SUIDGID or self.capable():
            return mode
        return kept_mode(mode, gid, self)


def kept_mode(mode: int, gid: int, who: Killer) -> int:
    """The mode a regular file of group ``gid`` keeps after a change that takes its
    privileges away, made by ``who`` (the module's rule)."""
    if not mode & SUIDGID or not stat.S_ISREG(mode):
        return mode
    mode &= ~stat.S_ISUID
    if mode & stat.S_ISGID and (mode & stat.S_IXGRP or not (who.in_group(gid) or who.capable())):
        mode &= ~stat.S_ISGID
    return mode


class PrivKills:
    """Which requests take setuid/setgid away, under the contract INIT agreed on, applied to
    the store's records (``kvfs.store.files.FileHandles.setattr``'s ``kill``). One per mount,
    ``KvfsOperations.privs``."""

    def __init__(self, files):
        self.files = files
        # 1: libfuse's HANDLE_KILLPRIV (the pyfuse3 transport): the daemon decides on every
        # write, truncate and chown; 2: HANDLE_KILLPRIV_V2 (kvfs's own transport sets it at
        # INIT): the kernel's flags on the request say when
        self.contract = 1
        self._writers: dict[int, Killer] = {}   # contract 1: fh -> who opened it for writing

    def on_setattr(self, fields, ctx):
        """What a SETATTR does to setuid/setgid: None, or ``kill(mode, gid)``. A SETATTR that
        changes nothing is the kernel's word that privileges go (both contracts): what it
        sends for ``chown(f, -1, -1)``, which clears them on ext4."""
        chown = fields.update_uid or fields.update_gid
        if not (chown or fields.update_size or fields.update_mode or fields.update_atime
                or fields.update_mtime or getattr(fields, "update_ctime", False)):
            return Killer.of(ctx).kept_mode
        if self.contract == 2:
            if not getattr(fields, "kill_suidgid", False):
                return None
            # a truncate carries the flag when the caller lacks CAP_FSETID; a chown always
            return Killer.of(ctx, None if chown else False).kept_mode
        if chown:
            return Killer.of(ctx).kept_mode
        if fields.update_size:
            return Killer.of(ctx).write_kept
        return None

    async def on_open(self, fh: int, ino: int, flags: int, ctx, kill: bool | None) -> None:
        """An open that writes (or truncates): an O_TRUNC's kill now (contract 2: where the
        kernel said so, FUSE_OPEN_KILL_SUIDGID); under contract 1 the opener is kept for the
        descriptor's writes."""
        if self.contract == 2:
            if kill and flags & os.O_TRUNC:
                await self._kill(ino, Killer.of(ctx, False).write_kept)
            return
        who = Killer.of(ctx)
        if flags & os.O_TRUNC:
            await self._kill(ino, who.write_kept)
        self._writers[fh] = who

    def on_create(self, fh: int, flags: int, ctx) -> None:
        if self.contract == 1 and flags & os.O_ACCMODE != os.O_RDONLY:
            self._writers[fh] = Killer.of(ctx)

    def write_may_kill(self, ino: int, flagged: bool) -> bool:
        """Whether a write may take setuid/setgid away (then :meth:`on_write`): the kernel
        flagged it, or contract 1, and the file has either bit (the write path's one test)."""
        if not (flagged or self.contract == 1):
            return False
        try:
            return bool(self.files.ns.inode(ino).mode & SUIDGID)
        except NamespaceError:          # gone meanwhile: the write itself answers for it
            return False

    async def on_write(self, fh: int, ino: int, ctx) -> None:
        """Before a write: ``ctx``, the writer where the kernel flagged the write
        (FUSE_WRITE_KILL_SUIDGID: it lacks CAP_FSETID); under contract 1 the descriptor's
        opener."""
        who = Killer.of(ctx, False) if ctx is not None else self._writers.get(fh)
        if who is not None:
            await self._kill(ino, who.write_kept)

    def released(self, fh: int) -> None:
        self._writers.pop(fh, None)

    async def _kill(self, ino: int, kill) -> None:
        try:
            if self.files.ns.inode(ino).mode & SUIDGID:     # the common case: one test
                await self.files.setattr(ino, kill=kill)
        except NamespaceError:          # gone meanwhile (unlinked, evicted): nothing to clear
            pass
