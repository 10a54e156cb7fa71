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
opened ``O_PATH`` first (no side effects), must be a memfd (not ``MFD_HUGETLB``) or a file
on a tmpfs -- told from its mount id in ``fdinfo`` and the caller's ``mountinfo``, before
anything asks the file's own filesystem (EINVAL otherwise, EXDEV for a file of this mount:
a descriptor of a slow or stalled filesystem, e.g. a FUSE file the caller serves itself,
would hold a daemon worker thread) -- must be a regular file, is reopened read-only from
that ``O_PATH`` descriptor, and the caller's own descriptor must be readable (``fdinfo``
flags) and still name the same inode afterwards. So the daemon never reads anything the
caller could not read itself. A pidfd taken at open time proves the process is still the
one that opened the control file (its pid was not reused).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import os
import select
import stat
import threading
import time

import trio

from kvfs.errors import NamespaceError
from kvfs.protocol import CONTROL_NAME_B
from kvfs.store import checksum
from kvfs.store.cred import Cred
from kvfs.store.index import ROOT_INO
from kvfs.store.sniff import peek_block_header

log = logging.getLogger(__name__)

TMP_PREFIX = b".kvfs-commit."
NAME_MAX = 255
_COPY_CHUNK = 64 << 20
_PIECE = 256 << 10         # a checksummed copy's piece: read, summed and written while in cache
GROUP_BYTES = 64 << 20     # entries whose copies go in one worker-thread call ...
GROUP_ENTRIES = 32         # ... at most (the RAM tier keeps 64 spare staging files: more
                           # buffers at once would create and unlink files)
COPIERS = 8                # copier threads, shared by all requests
COPY_SPLIT = 2             # threads copying one group (while the group before it is sealed)


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


_piece = threading.local()


def _copy_summed(src: int, dst: int, offset: int, length: int, chunk: int) -> tuple[int, tuple]:
    """:func:`_copy` that also checksums what it copies, in one pass: each piece is read into
    this thread's buffer, summed while it is in the CPU cache, and written from that same
    buffer, so the sums are of exactly the bytes stored (the caller may change its source
    meanwhile). Returns (bytes copied, ``checksum.summarize`` of them)."""
    buf = getattr(_piece, "buf", None)
    if buf is None:
        buf = _piece.buf = memoryview(bytearray(_PIECE))
    summer = checksum.Summer(chunk)
    done = 0
    while done < length:
        n = os.preadv(src, [buf[:min(_PIECE, length - done)]], offset + done)
        if n == 0:
            break
        summer.update(buf[:n])
        w = 0
        while w < n:
            w += os.pwrite(dst, buf[w:n], done + w)
        done += n
    return done, summer.result()


class Commits:
    """``Cache``'s batched commit (see the module docstring)."""

    def commit_parent(self, path: bytes, cred: Cred, noreplace: bool = False, dirmode: int | None = None,
                      made: list | None = None) -> tuple[int, bytes]:
        """``(parent inode, name)`` of ``path`` if ``cred`` may create or replace it there
        (EEXIST if it exists and ``noreplace``). With ``dirmode``, missing directories on the
        way are made as ``mkdir`` would (write and search on their parent; owned by the caller;
        ``(parent, name)`` of each appended to ``made``); without, a missing one is ENOENT."""
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
            child = self.ns.find(ino, c)
            if child is None and dirmode is not None:
                if not cred.may(rec, 3):
                    raise _err(errno.EACCES)
                child, _ = self.ns.make(ino, c, stat.S_IFDIR | (dirmode & 0o7777), cred.uid, cred.gid)
                if made is not None:
                    made.append((ino, c))
            if child is None:
                raise _err(errno.ENOENT)
            ino = child
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
                             noreplace: bool = False, dirmode: int | None = None,
                             made: list | None = None) -> list[tuple[int, bytes] | BaseException]:
        """Publish each entry (see the module docstring): per entry ``(parent, name)`` of the
        published file, or the exception that failed it. Entries go in groups of about
        GROUP_BYTES: temp files made, then every copy of the group in one worker-thread call
        (a thread hop per page would cost more than a small page's copy), then sealed and
        renamed one by one. The copies of the next group run while this one is sealed (its
        hashes in other worker threads): two cores busy, not one."""
        groups, start, size = [], 0, 0
        for i, e in enumerate(entries):
            if size and size + e.length > GROUP_BYTES or i - start >= GROUP_ENTRIES:
                groups.append(entries[start:i])
                start, size = i, 0
            size += max(0, e.length)
        if start < len(entries):
            groups.append(entries[start:])
        out: list = []
        pending: list = []          # begun groups not finished: (their entries, the copy's box)
        args = (cred, quotas, noreplace, dirmode, made)
        try:
            for k, group in enumerate(groups):
                if not pending:
                    pending.append(await self._begin_group(group, *args))
                cur, box = pending[0]
                copied = await _copied(box)
                if k + 1 < len(groups):         # the next group's copies, under this one's seals
                    pending.append(await self._begin_group(groups[k + 1], *args))
                pending.pop(0)
                out += await self._finish_group(cur, copied, quotas, noreplace)
        finally:
            for cur, box in pending:    # begun and never finished (cancelled): nothing left behind
                with trio.CancelScope(shield=True):
                    await box["done"].wait()        # the copies wrote into these buffers
                    await self._finish_group(cur, None, quotas, noreplace)
        return out

    async def _begin_group(self, entries: list[CommitEntry], cred: Cred, quotas, noreplace: bool,
                           dirmode: int | None, dirs: list | None) -> tuple[list, dict]:
        """Begin each entry (its checks and buffer; a failure is that entry's result), then
        start the group's copies in a worker thread (:func:`_copied` waits for them)."""
        made: list = []
        try:
            for e in entries:
                try:
                    made.append(await self._begin(e, cred, quotas, noreplace, dirmode, dirs))
                except trio.Cancelled:
                    raise
                except Exception as exc:        # noqa: BLE001 -- each entry fails on its own
                    made.append(exc)
            # checksummed by the copy where nobody else can reach the buffer before its seal
            # (published directly); a temp file is sealed, and summed, as any close would
            chunk = self.store.chunk_size
            jobs = [(m.entry.src, self._copy_target(m), m.entry.offset, m.entry.length,
                     chunk if m.fh is None else None)
                    for m in made if isinstance(m, _Pending) and m.entry.length]
        except BaseException:               # cancelled, or a buffer that could not be mapped
            for m in made:
                if isinstance(m, _Pending):
                    await self._clean(m, quotas)
            raise
        return made, _start_copies(jobs)

    async def _finish_group(self, made: list, copied: list | None, quotas, noreplace: bool) -> list:
        """Seal and publish each begun entry with its copy's result (``copied`` None: the
        request is being cancelled, only clean up); returns the per-entry results. Every
        entry is cleaned up, also those after a cancellation."""
        copied_it = iter(copied or [])
        out: list = []
        for i, m in enumerate(made):
            if not isinstance(m, _Pending):
                out.append(m)
                continue
            try:
                if copied is None:
                    raise _err(errno.ECANCELED, "the request was cancelled")
                got = next(copied_it) if m.entry.length else 0
                out.append(await self._finish(m, got, noreplace))
            except trio.Cancelled:
                for rest in made[i + 1:]:
                    if isinstance(rest, _Pending):
                        await self._clean(rest, quotas)
                raise
            except Exception as exc:        # noqa: BLE001
                log.debug("commit of %r failed: %r", m.entry.path, exc)
                out.append(exc)
            finally:
                await self._clean(m, quotas)
        return out

    async def _clean(self, m: "_Pending", quotas) -> None:
        """What an entry leaves behind unless it was published: its handle, buffer, temp file
        (shielded: a cancelled request still cleans up)."""
        with trio.CancelScope(shield=True):
            if m.fh in self.handles:
                if quotas is not None:
                    quotas.forget_handle(m.fh)
                await self.release(m.fh)
            if m.tmp is None:
                if m.staging is not None:   # not taken by a published object
                    m.staging.discard()
                    m.staging = None
            elif not m.published:
                try:
                    await self.unlink(m.parent, m.tmp)
                except NamespaceError:
                    pass

    async def _begin(self, e: CommitEntry, cred: Cred, quotas, noreplace: bool, dirmode: int | None = None,
                     dirs: list | None = None) -> "_Pending":
        """Checks, the (empty) buffer, and with a quota the hidden temp file and its room."""
        if e.offset < 0 or e.length < 0:
            raise _err(errno.EINVAL, "negative offset or length")
        parent, name = self.commit_parent(e.path, cred, noreplace, dirmode, dirs)
        if self._direct(quotas):
            return _Pending(e, parent, name, None, None, None, self.store.ram.new_staging(), cred=cred)
        tmp = TMP_PREFIX + os.urandom(8).hex().encode()
        fh, ino, _ = await self.create(parent, tmp, e.mode & 0o777, cred.uid, cred.gid, os.O_WRONLY)
        m = _Pending(e, parent, name, tmp, fh, ino, None)
        try:
            if quotas is not None and quotas.limits and e.length:
                await quotas.admit_write(fh, 0, e.length)
            m.staging = await self._staging(self.handles[fh].ws)
        except BaseException:
            if quotas is not None:
                quotas.forget_handle(fh)
            await self.release(fh)
            try:
                await self.unlink(parent, tmp)
            except NamespaceError:
                pass
            raise
        return m

    def _direct(self, quotas) -> bool:
        """Entries are published directly (:meth:`_publish`) unless a quota must admit
        their bytes through a write handle (then: temp file, seal, rename)."""
        return quotas is None or not quotas.limits

    async def _publish(self, m: "_Pending", noreplace: bool, summary: tuple | None = None) -> tuple[int, bytes]:
        """Seal the entry's buffer into an object and install it under its final name in one
        index transaction (Namespace.publish): no temp inode, no rename, one group commit.
        ``summary``: the buffer's checksums, taken by the copy that filled it."""
        staging, m.staging = m.staging, None
        ram = self.store.ram
        if ram.used > ram.capacity and not staging.spilled:     # as a write would (_written)
            self.store.kick()
            await staging.spill(self.spill_dir)
        elif ram.used > ram.capacity * self.store.high:
            self.store.kick()
        t0 = time.perf_counter()
        try:
            kv = await peek_block_header(staging)
            key = self.ns.path_of(m.parent).rstrip("/") + "/" + m.name.decode("utf-8", "surrogateescape")
            obj = await self.store.create(self.index.new_id(b"ino"), staging, key, 1, summary)
        finally:
            staging.discard()               # what the object did not adopt
        kvrec = {k: str(kv.get(k, "")) for k in ("namespace", "hash", "parent", "tokens")} if kv else None
        gone = self._describe_name(m.parent, m.name)
        try:
            _, dropped = self.ns.publish(m.parent, m.name, m.entry.mode, m.cred.uid, m.cred.gid, obj,
                                         kvrec, noreplace, self.is_open)
        except NamespaceError:
            with self.index.write() as txn:
                self.store.drop(txn, obj)
            await self.store.release_space(obj)
            raise
        m.published = True
        if dropped is not None:
            self._removed(dropped, gone)
            await self.store.release_space(dropped)
        self.telemetry.latency["seal"].observe(time.perf_counter() - t0)
        self.telemetry.events.emit("stored", obj, self.store.top_tier(obj), path=key, kv=kvrec or {})
        if self.on_renamed is not None:     # a shared volume publishes the name
            await self.on_renamed(m.parent, m.name)
        return m.parent, m.name

    def _copy_target(self, m: "_Pending") -> int | None:
        """The staging file the bytes are copied to; None: a buffer below the RAM tier's
        ``mapped_min`` stays in memory (the bytes are read, then written to it)."""
        staging = m.staging
        if staging.mem is not None and m.entry.length >= self.store.ram.mapped_min:
            staging._to_file()
        return staging.fd if staging.mem is None else None

    async def _finish(self, m: "_Pending", got, noreplace: bool) -> tuple[int, bytes]:
        """Account the copied bytes, seal as the last close would, rename over the name."""
        if isinstance(got, BaseException):
            raise got
        summary = None
        if isinstance(got, tuple):          # the copy's checksums of what it stored
            got, summary = got
        staging = m.staging
        if isinstance(got, bytes):          # a small buffer kept in memory
            await staging.write(0, got)
            got = len(got)
        if got > staging.size:
            staging._account(got)
        if got != m.entry.length:
            raise _err(errno.EINVAL, f"the source holds {got} of the {m.entry.length} bytes named")
        if m.fh is None:
            return await self._publish(m, noreplace, summary)
        await self._written(self.handles[m.fh].ws, staging)
        await self.flush(m.fh)              # the seal: as the last close would
        await self.release(m.fh)
        rec = self.index.get_inode(m.ino)
        if rec is None or rec.get("oid") is None:
            raise _err(errno.EIO, "the committed file was not sealed")
        await self.rename(m.parent, m.tmp, m.parent, m.name, 1 if noreplace else 0)
        m.published = True
        return m.parent, m.name


@dataclasses.dataclass
class _Pending:
    entry: CommitEntry
    parent: int
    name: bytes
    tmp: bytes | None           # None: published directly (Commits._publish), no temp file
    fh: int | None
    ino: int | None
    staging: object
    published: bool = False
    cred: Cred | None = None


def _read(src: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of ``src`` (fewer at its end)."""
    parts, done = [], 0
    while done < length:
        b = os.pread(src, length - done, offset + done)
        if not b:
            break
        parts.append(b)
        done += len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


_copiers: concurrent.futures.ThreadPoolExecutor | None = None


def _start_copies(jobs: list[tuple[int, int | None, int, int]]) -> dict:
    """Run :func:`_copy_all` over ``jobs`` in copier threads (not trio tasks: no nursery, no
    task of the request to cancel), split in up to COPY_SPLIT interleaved parts that copy in
    parallel; the returned box's ``done`` event is set when every part ended."""
    global _copiers
    box: dict = {"done": trio.Event(), "copied": [None] * len(jobs), "error": None}
    if not jobs:
        box["done"].set()
        return box
    token = trio.lowlevel.current_trio_token()
    if _copiers is None:
        _copiers = concurrent.futures.ThreadPoolExecutor(COPIERS, thread_name_prefix="kvfs-commit-copy")
    parts = min(COPY_SPLIT, len(jobs))
    left = [parts]
    lock = threading.Lock()

    def work(k: int) -> None:
        try:
            box["copied"][k::parts] = _copy_all(jobs[k::parts])
        except BaseException as e:          # noqa: BLE001 -- raised in the trio thread
            box["error"] = e
        finally:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    token.run_sync_soon(box["done"].set)
                except trio.RunFinishedError:   # the daemon stopped meanwhile
                    pass
    for k in range(parts):
        _copiers.submit(work, k)
    return box


async def _copied(box: dict) -> list:
    """Wait for a group's copies (:func:`_start_copies`); their per-job results."""
    await box["done"].wait()
    if box["error"] is not None:
        raise box["error"]
    return box["copied"]


def _copy_all(jobs: list[tuple[int, int | None, int, int, int | None]]) -> list:
    """Each ``(src, dst, offset, length, chunk)`` copied (worker thread): bytes copied, the
    bytes read when ``dst`` is None, or the error; with a ``chunk`` size, a pair of that and
    the checksums of the copy (``checksum.summarize``), taken while the bytes are in cache."""
    out: list = []
    for src, dst, off, n, chunk in jobs:
        try:
            if dst is None:
                data = _read(src, off, n)
                out.append(data if chunk is None else (data, checksum.summarize(memoryview(data), chunk)))
            elif chunk is None:
                out.append(_copy(src, dst, off, n))
            else:
                out.append(_copy_summed(src, dst, off, n, chunk))
        except OSError as e:
            out.append(e)
    return out