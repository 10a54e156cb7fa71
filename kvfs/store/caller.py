"""The process behind a ``.kvfs/commit`` descriptor, and the two sources of the bytes its
entries name (kvfs.store.commit copies them; kvfs/fs/commitctl.py documents the request).

* **A descriptor** (``\\0fd N``): reached through ``/proc/<pid>/fd/<n>`` of the process that
  opened the control file, never through a path the caller names: it is opened ``O_PATH``
  first (no side effects), must be a memfd (not ``MFD_HUGETLB``) or a file on a tmpfs -- told
  from its mount id in ``fdinfo`` and the caller's ``mountinfo``, before anything asks the
  file's own filesystem (EINVAL otherwise, EXDEV for a file of this mount: a descriptor of a
  slow or stalled filesystem, e.g. a FUSE file the caller serves itself, would hold a daemon
  worker thread) -- must be a regular file, is reopened read-only from that ``O_PATH``
  descriptor, and the caller's own descriptor must be readable (``fdinfo`` flags) and still
  name the same inode afterwards. So the daemon never reads anything the caller could not
  read itself.
* **Its memory** (``\\0mem``): entries name address ranges of that process, read with
  ``process_vm_readv(2)`` -- one copy (caller's pages into the daemon's buffer) instead of two
  (the caller's copy into a memfd, then the daemon's). Only the opener's own address space is
  ever read (its pid is the kernel's, from the open; nothing in the request names a process),
  and only while the process is one its own user could read with ``ptrace``: ``/proc/<pid>/mem``
  owned by the user who opened the control file (the kernel gives a non-dumpable process --
  setuid, or ``PR_SET_DUMPABLE`` 0 -- to root), else EPERM. A bad range is EFAULT for its entry.

A pidfd taken at open time proves the process is still the one that opened the control file
(its pid was not reused): checked before a descriptor is opened, and after every read of the
caller's memory (a process that ended during the read fails the entry with ESRCH; while it
lives its pid names nobody else). A control descriptor is a capability of the process that
opened it: whoever it is handed to can publish what that process can read, its memory included.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import stat

from kvfs.errors import NamespaceError

log = logging.getLogger(__name__)

SOURCE_FS = ("tmpfs",)      # filesystems a commit reads from (besides memfds)


def _err(code: int, msg: str = "") -> NamespaceError:
    return NamespaceError(code, msg or os.strerror(code))


def _fdinfo(path: str) -> dict[str, str]:
    with open(path) as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


_memfd_mnt: list[str] = []


def memfd_mount_id() -> str:
    """The mount id of memfds (the kernel's internal shmem mount), learnt from one of ours."""
    if not _memfd_mnt:
        fd = os.memfd_create("kvfs-probe", os.MFD_CLOEXEC)
        try:
            _memfd_mnt.append(_fdinfo(f"/proc/self/fdinfo/{fd}")["mnt_id"].strip())
        finally:
            os.close(fd)
    return _memfd_mnt[0]


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
        # poll, not select: a daemon holding many objects open has descriptors past select's
        # 1024 (ValueError there failed every commit with EIO)
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return not p.poll(0)

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
            mnt = self._check_source_fs(n, opath, mount_dev)
            st = os.fstat(opath)            # a memfd or tmpfs file: answered at once
            if not stat.S_ISREG(st.st_mode):
                raise _err(errno.EBADF, f"descriptor {n} is not a regular file")
            fd = os.open(f"/proc/self/fd/{opath}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        finally:
            os.close(opath)
        try:
            self._check_readable(n, st, mnt)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_source_fs(self, n: int, opath: int, mount_dev: int) -> str:
        """The mount id of ``opath`` (our O_PATH descriptor of the caller's fd ``n``) if it is
        a memfd's or a tmpfs mount's; EXDEV for this mount, EINVAL for any other. Reads only
        /proc: nothing here reaches the file's own filesystem."""
        try:
            mnt = _fdinfo(f"/proc/self/fdinfo/{opath}")["mnt_id"].strip()
        except (OSError, KeyError, ValueError):
            raise _err(errno.EBADF, f"descriptor {n} went away") from None
        if mnt == memfd_mount_id():
            return mnt
        fstype, dev = "", -1
        try:
            with open(f"/proc/{self.tgid}/mountinfo") as f:     # the caller's mount namespace
                for line in f:
                    fields = line.split()
                    if fields and fields[0] == mnt and " - " in line:
                        fstype = line.split(" - ", 1)[1].split()[0]
                        major, minor = fields[2].split(":")
                        dev = os.makedev(int(major), int(minor))
                        break
        except (OSError, ValueError, IndexError):
            raise _err(errno.ESRCH) from None
        if fstype in SOURCE_FS:
            return mnt
        if dev == mount_dev:
            raise _err(errno.EXDEV, f"descriptor {n} is a file of this mount")
        raise _err(errno.EINVAL, f"descriptor {n} is not a memfd or a tmpfs file ({fstype or 'unknown'})")

    def _check_readable(self, n: int, st: os.stat_result, mnt: str) -> None:
        """The caller's fd ``n`` may read (not O_WRONLY, not O_PATH) and still names ``st``'s
        inode on mount ``mnt`` (checked in fdinfo before the stat, so the stat reaches only a
        memfd or tmpfs), and the caller is still the process that opened the control file."""
        try:
            info = _fdinfo(f"/proc/{self.tgid}/fdinfo/{n}")
            flags = int(info["flags"].strip(), 8)
            if info["mnt_id"].strip() != mnt:
                raise _err(errno.EBADF, f"descriptor {n} changed")
            now = os.stat(f"/proc/{self.tgid}/fd/{n}")
        except (OSError, KeyError, ValueError):
            raise _err(errno.EBADF, f"descriptor {n} went away") from None
        if flags & os.O_PATH or flags & os.O_ACCMODE == os.O_WRONLY:
            raise _err(errno.EBADF, f"descriptor {n} is not open for reading")
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _err(errno.EBADF, f"descriptor {n} changed")
        if not self.alive():
            raise _err(errno.ESRCH)

    def memory(self, uid: int) -> "CallerMemory":
        """This process's address space as the source of ``\\0mem`` entries: EPERM unless
        ``/proc/<pid>/mem`` belongs to ``uid`` (who opened the control file; see the module
        docstring), ESRCH once it is gone, ENOSYS where ``process_vm_readv`` is missing."""
        if not self.alive():
            raise _err(errno.ESRCH)
        try:
            owner = os.stat(f"/proc/{self.tgid}/mem").st_uid      # root once not dumpable
        except OSError:
            raise _err(errno.ESRCH) from None
        if owner != uid:
            raise _err(errno.EPERM, f"process {self.tgid} is not dumpable by uid {uid}")
        if _vm_readv() is None:
            raise _err(errno.ENOSYS, "no process_vm_readv")
        return CallerMemory(self)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_pvr: list = []
_IOV_MAX = 1024


def _vm_readv():
    """libc's ``process_vm_readv`` (a ctypes call: the GIL is released while it copies), or None."""
    if not _pvr:
        fn = None
        try:
            fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                           ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
            fn.restype = ctypes.c_ssize_t
        except (OSError, AttributeError):
            fn = None
        _pvr.append(fn)
    return _pvr[0]


class CallerFile:
    """A source of entries: the daemon's read-only descriptor of a caller's file
    (:meth:`CallerProcess.open_fd`), read at the offsets its entries name (copier threads)."""

    def __init__(self, fd: int):
        self.fd = fd

    def readinto(self, view: memoryview, offset: int, skip: int = 0) -> int:
        """Fill ``view`` from ``offset + skip``: the bytes read (fewer at the file's end)."""
        return os.preadv(self.fd, [view], offset + skip)

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer at the file's end)."""
        parts, done = [], 0
        while done < length:
            b = os.pread(self.fd, length - done, offset + done)
            if not b:
                break
            parts.append(b)
            done += len(b)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        os.close(self.fd)


class CallerMemory:
    """A source of entries: the caller's memory, read at the address ranges its entries name
    (copier threads); the same reads as :class:`CallerFile`."""

    fd = None                           # no descriptor to sendfile from

    def __init__(self, process: CallerProcess):
        self.process = process

    def close(self) -> None:
        pass

    def readinto(self, view: memoryview, ranges: tuple, skip: int = 0) -> int:
        """Fill the writable ``view`` with the bytes of ``ranges`` (``((address, length), ...)``,
        read as one stream) from ``skip`` bytes in: its length, or EFAULT (an OSError) when a
        range is not the caller's memory or too short, ESRCH when the caller is gone."""
        n = len(view)
        done = 0
        while done < n:
            remote, want, total = [], n - done, 0
            at = skip + done
            for addr, length in ranges:         # the ranges' part from ``at`` on, up to ``want``
                if at >= length:
                    at -= length
                    continue
                take = min(length - at, want - total)
                remote.append((addr + at, take))
                total += take
                at = 0
                if total == want or len(remote) == _IOV_MAX:
                    break
            if not remote:
                raise OSError(errno.EFAULT, "the ranges hold fewer bytes than the entry's length")
            local = _Iovec(ctypes.addressof(ctypes.c_char.from_buffer(view, done)), n - done)
            riov = (_Iovec * len(remote))(*[_Iovec(a, k) for a, k in remote])
            got = _vm_readv()(self.process.tgid, ctypes.byref(local), 1, riov, len(remote), 0)
            if got <= 0:
                e = ctypes.get_errno() if got < 0 else errno.EFAULT
                if not self.process.alive():
                    e = errno.ESRCH
                raise OSError(e, f"reading the caller's memory at {remote[0][0]:#x}: {os.strerror(e)}")
            done += got
        if not self.process.alive():    # the pid may have been reused during the read
            raise OSError(errno.ESRCH, "the caller ended while its memory was read")
        return n

    def read(self, ranges: tuple, length: int) -> bytes:
        buf = bytearray(length)
        if length:
            self.readinto(memoryview(buf), ranges)
        return bytes(buf)
