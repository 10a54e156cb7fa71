"""Batched publication of files whose bytes the caller hands over by descriptor (the
``.kvfs/commit`` control file, kvfs/fs/control.py documents the request); a mixin of ``Cache``.

A client writes many pages into memory it owns (a memfd) and names them in one request. For
each entry the daemon

1. resolves the target's parent as the caller (search permission on every directory, write
   and search on the parent, the sticky-bit rule when the name exists): the checks the kernel
   makes for ``create`` and ``rename`` with ``default_permissions``;
2. creates a hidden temporary file there owned by the caller (``Cache.create``), so quotas,
   admission, the staging buffer's accounting and spilling are those of any write;
3. copies the entry's byte range from the caller's descriptor into that daemon-owned buffer
   (``sendfile``, in a worker thread) -- the caller cannot change what is stored afterwards;
4. seals it exactly as the last close would (the checksum is of the daemon's copy; events,
   metrics, group-commit durability of the index as for a close) and renames it over the
   target name (a replaced file is released as by ``rename``).

Each entry succeeds or fails on its own; a failed entry leaves nothing behind.

The caller's descriptor is reached through ``/proc/<pid>/fd/<n>`` of the process that opened
the control file (:class:`CallerProcess`), never through a path the caller names: it is
opened ``O_PATH`` first (no side effects), must be a regular file outside this mount, is
reopened read-only from that ``O_PATH`` descriptor, and the caller's own descriptor must be
readable (``fdinfo`` flags) and still name the same inode afterwards. So the daemon never reads
anything the caller could not read itself. A pidfd taken at open time proves the process is
still the one that opened the control file (its pid was not reused).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import select
import stat

import trio

from kvfs.errors import NamespaceError
from kvfs.protocol import CONTROL_NAME_B
from kvfs.store.cred import Cred
from kvfs.store.index import ROOT_INO

log = logging.getLogger(__name__)

TMP_PREFIX = b".kvfs-commit."
NAME_MAX = 255
_COPY_CHUNK = 64 << 20


def _err(code: int, msg: str = "") -> NamespaceError:
    return NamespaceError(code, msg or os.strerror(code))


class CallerProcess:
    """The process that opened a ``.kvfs/commit`` descriptor, held by pidfd."""

    def __init__(self, pid: int):
        self.tgid = self._tgid(pid)
        self.pidfd = os.pidfd_open(self.tgid)

    @staticmethod
    def _tgid(pid: int) -> int:
        """FUSE sends the calling thread's id; its process is the thread group."""
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Tgid:"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        raise _err(errno.ESRCH, f"process {pid} is gone")

    def alive(self) -> bool:
        if self.pidfd < 0:
            return False
        readable, _, _ = select.select([self.pidfd], [], [], 0)
        return not readable

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def open_fd(self, n: int, mount_dev: int) -> int:
        """A read-only descriptor of the regular file that the caller's fd ``n`` names, or
        an errno (EBADF: not a descriptor of a readable regular file; ESRCH: caller gone)."""
        if n < 0 or not self.alive():
            raise _err(errno.EBADF if n < 0 else errno.ESRCH)
        link = f"/proc/{self.tgid}/fd/{n}"
        try:
            opath = os.open(link, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _err(errno.EBADF, f"the caller has no descriptor {n}") from None
        try:
            st = os.fstat(opath)
            if not stat.S_ISREG(st.st_mode):
                raise _err(errno.EBADF, f"descriptor {n} is not a regular file")
            if st.st_dev == mount_dev:
                raise _err(errno.EXDEV, f"descriptor {n} is a file of this mount")
            fd = os.open(f"/proc/self/fd/{opath}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        finally:
            os.close(opath)
        try:
            self._check_readable(n, st)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_readable(self, n: int, st: os.stat_result) -> None:
        """The caller's fd ``n`` may read (not O_WRONLY, not O_PATH) and still names ``st``'s
        inode, and the caller is still the process that opened the control file."""
        try:
            with open(f"/proc/{self.tgid}/fdinfo/{n}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
            now = os.stat(f"/proc/{self.tgid}/fd/{n}")
        except (OSError, StopIteration, ValueError):
            raise _err(errno.EBADF, f"descriptor {n} went away") from None
        if flags & os.O_PATH or flags & os.O_ACCMODE == os.O_WRONLY:
            raise _err(errno.EBADF, f"descriptor {n} is not open for reading")
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _err(errno.EBADF, f"descriptor {n} changed")
        if not self.alive():
            raise _err(errno.ESRCH)


@dataclasses.dataclass
class CommitEntry:
    path: bytes             # relative to the mount root
    src: int                # the daemon's read-only descriptor of the caller's bytes
    offset: int
    length: int
    mode: int = 0o644


def _copy(src: int, dst: int, offset: int, length: int) -> int:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the start of ``dst`` (worker thread)."""
    os.lseek(dst, 0, os.SEEK_SET)
    done = 0
    while done < length:
        n = os.sendfile(dst, src, offset + done, min(_COPY_CHUNK, length - done))
        if n == 0:
            break
        done += n
    return done


class Commits:
    """``Cache``'s batched commit (see the module docstring)."""

    def commit_parent(self, path: bytes, cred: Cred, noreplace: bool = False) -> tuple[int, bytes]:
        """``(parent inode, name)`` of ``path`` if ``cred`` may create or replace it there
        (EEXIST if it exists and ``noreplace``)."""
        comps = path.split(b"/")
        if any(c in (b"", b".", b"..") or len(c) > NAME_MAX for c in comps):
            raise _err(errno.EINVAL, "a commit path has empty, '.', '..' or too long components")
        *dirs, name = comps
        ino = ROOT_INO
        for c in dirs:
            rec = self.ns.inode(ino)
            if not stat.S_ISDIR(rec["mode"]):
                raise _err(errno.ENOTDIR)
            if not cred.may(rec, 1):
                raise _err(errno.EACCES)
            if ino == ROOT_INO and c == CONTROL_NAME_B:
                raise _err(errno.EPERM, ".kvfs is reserved")
            ino = self.ns.lookup(ino, c)
        prec = self.ns.inode(ino)
        if not stat.S_ISDIR(prec["mode"]):
            raise _err(errno.ENOTDIR)
        if not cred.may(prec, 3):
            raise _err(errno.EACCES)
        if ino == ROOT_INO and name == CONTROL_NAME_B:
            raise _err(errno.EPERM, ".kvfs is reserved")
        old = self.index.lookup(ino, name)
        if old is not None and noreplace:
            raise _err(errno.EEXIST)
        if old is not None:
            orec = self.index.get_inode(old)
            if orec is not None and stat.S_ISDIR(orec["mode"]):
                raise _err(errno.EISDIR)
            if (orec is not None and prec["mode"] & stat.S_ISVTX and cred.uid != 0
                    and cred.uid not in (orec["uid"], prec["uid"])):
                raise _err(errno.EPERM)      # sticky directory: only the owner replaces
        return ino, name

    async def commit_entries(self, entries: list[CommitEntry], cred: Cred, quotas=None,
                             noreplace: bool = False) -> list[tuple[int, bytes] | BaseException]:
        """Publish each entry (see the module docstring): per entry ``(parent, name)`` of the
        published file, or the exception that failed it."""
        out: list = []
        for e in entries:
            try:
                out.append(await self._commit_one(e, cred, quotas, noreplace))
            except trio.Cancelled:
                raise
            except Exception as exc:        # noqa: BLE001 -- each entry fails on its own
                log.debug("commit of %r failed: %r", e.path, exc)
                out.append(exc)
        return out

    async def _commit_one(self, e: CommitEntry, cred: Cred, quotas, noreplace: bool) -> tuple[int, bytes]:
        if e.offset < 0 or e.length < 0:
            raise _err(errno.EINVAL, "negative offset or length")
        parent, name = self.commit_parent(e.path, cred, noreplace)
        tmp = TMP_PREFIX + os.urandom(8).hex().encode()
        fh, ino, _ = await self.create(parent, tmp, e.mode & 0o777, cred.uid, cred.gid, os.O_WRONLY)
        published = False
        try:
            try:
                if quotas is not None and quotas.limits and e.length:
                    await quotas.admit_write(fh, 0, e.length)
                await self._fill(self.handles[fh].ws, e)
                await self.flush(fh)         # the seal: as the last close would
            finally:
                if quotas is not None:
                    quotas.forget_handle(fh)
                await self.release(fh)
            if self.index.get_inode(ino) is None or self.index.get_inode(ino).get("oid") is None:
                raise _err(errno.EIO, "the committed file was not sealed")
            await self.rename(parent, tmp, parent, name, 1 if noreplace else 0)
            published = True
        finally:
            if not published:
                try:
                    await self.unlink(parent, tmp)
                except NamespaceError:
                    pass
        return parent, name

    async def _fill(self, ws, e: CommitEntry) -> None:
        """Copy the entry's bytes into the file's (new, empty) staging buffer."""
        staging = await self._staging(ws)
        if not e.length:
            return
        got = await trio.to_thread.run_sync(_copy, e.src, staging.fd, e.offset, e.length)
        if got > staging.size:
            staging._account(got)
        if got != e.length:
            raise _err(errno.EINVAL, f"the source holds {got} of the {e.length} bytes named")
        ws.dirty = True
        ws.touch()
        ram = self.store.ram
        if ram.used > ram.capacity and not staging.spilled:
            self.store.kick()
            await staging.spill(self.spill_dir)
        elif ram.used > ram.capacity * self.store.high:
            self.store.kick()
