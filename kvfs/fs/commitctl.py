"""``.kvfs/commit``: publish a batch of files whose bytes the caller holds in a descriptor.

Open ``.kvfs/commit`` read-write, write a request at offset 0, read the answer::

    request   := (line "\\n")*
    line      := entry | directive
    entry     := OFFSET " " LENGTH " " PATH     decimal byte range of the current fd; PATH
                                                 relative to the current base
    directive := "\\0fd N" | "\\0mem" | "\\0base DIR" | "\\0mode OCTAL" | "\\0noreplace" | "\\0mkdir OCTAL"

``\\0fd N`` names a descriptor of the process that opened the control file (a memfd or a
tmpfs file open for reading: any other filesystem answers EINVAL, a file of this mount EXDEV, a
descriptor not open for reading EBADF); ``\\0mem``: later entries name that process's own
memory, OFFSET an address, or ``ADDR+LEN,ADDR+LEN,...`` for a file in several pieces (read with
``process_vm_readv``: one copy fewer; EPERM for a process its user could not ``ptrace``, EFAULT
for a range it does not map, EXDEV for a range mapped from a file of this mount). One of the two is required
before the first entry; a request may switch between them;
``\\0base DIR`` as for ``lookup``; ``\\0mode`` the permission bits of later entries (default
0644); ``\\0noreplace`` keeps an existing target (its entry answers EEXIST, as
``rename(RENAME_NOREPLACE)``; default: replace it, as ``rename``); ``\\0mkdir OCTAL`` makes
missing directories on an entry's path (as ``mkdir`` with those permission bits would, as
the caller: write and search on their parent; default: a missing directory is ENOENT). The answer is ``{"results": [errno, ...]}``, one per entry in order: 0 = the file was
published as if the caller had written a temp file beside it, closed it and renamed it over
PATH; otherwise the errno that failed it (nothing was published for it). A request that
does not parse fails as a whole with EINVAL (kvfs.protocol.parse_commit_request reads it).

Who asks: the uid, gid and groups, and the descriptor table or memory, of the process that
opened the control file (kvfs.store.caller documents the checks). Requires the daemon to run
as root or as the caller's user (it reads ``/proc/<pid>/fd`` or the process's memory): otherwise
entries fail with EACCES or EPERM and clients write through the mount instead.
"""
from __future__ import annotations

import errno
import logging
import os

import pyfuse3
import trio

from kvfs import protocol
from kvfs.errors import NamespaceError
from kvfs.fs.errmap import to_errno
from kvfs.store.caller import CallerFile, CallerProcess
from kvfs.store.callermaps import mount_spans, overlaps
from kvfs.store.commit import CommitEntry

log = logging.getLogger(__name__)

MAX_ENTRIES = 65536


def _mount_dev(mountpoint: str) -> int:
    """The device number of the mount at ``mountpoint`` (from mountinfo: a stat of our own
    mount from the daemon's loop would wait on itself); -1 if not found."""
    dev = -1
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4].replace("\\040", " ") == mountpoint:
                    major, minor = fields[2].split(":")
                    dev = os.makedev(int(major), int(minor))
    except (OSError, ValueError):
        pass
    return dev


class CommitControl:
    def __init__(self, store, describe):
        self.store = store
        self.describe = describe
        self._dev: int | None = None
        self.invalidate = None          # async (names) -> None, set by the fs (kernel entries)

    def caller_process(self, pid: int) -> CallerProcess:
        try:
            return CallerProcess(pid)
        except (OSError, NamespaceError) as e:
            raise pyfuse3.FUSEError(e.errno or errno.ESRCH) from None

    def mount_dev(self) -> int:
        if self._dev is None:
            self._dev = _mount_dev(str(self.describe().get("mountpoint", "")))
        return self._dev

    async def serve(self, h, raw: bytes) -> dict:
        """Serve one request (EINVAL if it does not parse, E2BIG past MAX_ENTRIES entries);
        the answer, ``kvfs.protocol.commit_answer``."""
        try:
            reqs, noreplace, dirmode = protocol.parse_commit_request(raw)
        except ValueError:
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        if len(reqs) > MAX_ENTRIES:
            raise pyfuse3.FUSEError(errno.E2BIG)
        fds: dict[int, int | Exception] = {}
        results: list[int] = [0] * len(reqs)
        entries, where = [], []
        spans = None                        # the caller's mappings of this mount's files
        try:
            for i, (n, off, length, path, mode) in enumerate(reqs):
                if n not in fds:
                    try:
                        if n == protocol.COMMIT_MEMORY:
                            fds[n] = h.process.memory(h.cred.uid)
                        else:   # in a thread: a descriptor of this very mount makes fstat ask us
                            fds[n] = CallerFile(await trio.to_thread.run_sync(h.process.open_fd, n, self.mount_dev()))
                    except (OSError, NamespaceError) as e:
                        fds[n] = e
                src = fds[n]
                if isinstance(src, Exception):
                    results[i] = to_errno(src)
                    continue
                if n == protocol.COMMIT_MEMORY:
                    if spans is None:
                        spans = await trio.to_thread.run_sync(mount_spans, h.process.tgid, self.mount_dev())
                    if overlaps(spans, off):
                        results[i] = errno.EXDEV        # kvfs.store.callermaps
                        continue
                entries.append(CommitEntry(path, src, off, length, mode))
                where.append(i)
            made: list = []
            done = await self.store.commits.commit_entries(entries, h.cred, getattr(self.store, "quotas", None),
                                                   noreplace, dirmode, made)
        finally:
            for src in fds.values():
                if not isinstance(src, Exception):
                    src.close()
        names = list(made)                  # the kernel may hold negative entries for them
        for i, r in zip(where, done):
            if isinstance(r, BaseException):
                results[i] = to_errno(r)
            else:
                names.append(r)
        if names and self.invalidate is not None:
            await self.invalidate(names)
        failed = sum(1 for r in results if r)
        if failed:
            log.debug("commit: %d of %d entries failed", failed, len(results))
        return protocol.commit_answer(results)
