"""Batched publication of files whose bytes the caller hands over by descriptor (the
``.kvfs/commit`` control file, kvfs/fs/control.py documents the request): the ``commits``
member of ``Store``.

A client names many pages in one request: byte ranges of a memfd it wrote them to, or of its
own memory. For
each entry the daemon

1. resolves the target's parent as the caller (search permission on every directory, write
   and search on the parent, the sticky-bit rule when the name exists): the checks the kernel
   makes for ``create`` and ``rename`` with ``default_permissions``;
2. creates a hidden temporary file there owned by the caller (``FileHandles.create``), so quotas,
   admission, the staging buffer's accounting and spilling are those of any write;
3. copies the entry's byte range from the caller's descriptor or memory into that
   daemon-owned buffer (copier threads) -- the caller cannot change what is stored afterwards;
4. seals it exactly as the last close would (the checksum is of the daemon's copy; events,
   metrics, group-commit durability of the index as for a close) and renames it over the
   target name (a replaced file is released as by ``rename``).

Each entry succeeds or fails on its own; a failed entry leaves nothing behind.

Where the bytes come from -- a descriptor of the process that opened the control file
(``\0fd N``), or its own memory (``\0mem``) -- and what is checked before they are read:
kvfs.store.caller.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import mmap
import os
import stat
import threading
import time
from typing import Awaitable, Callable

import trio

from kvfs.errors import NamespaceError
from kvfs.protocol import CONTROL_NAME_B
from kvfs.store import checksum, ramroom
from kvfs.store.caller import CallerFile, CallerMemory, _err
from kvfs.store.cred import Cred
from kvfs.store.files import FileHandles
from kvfs.store.index import ROOT_INO, Index
from kvfs.store.nameops import NameOps
from kvfs.store.namespace import Namespace
from kvfs.store.objects import ObjectStore
from kvfs.store.sniff import HEAD, peek_block_header

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


@dataclasses.dataclass
class CommitEntry:
    path: bytes             # relative to the mount root
    src: "CallerFile | CallerMemory"    # the caller's bytes: a descriptor of them, or its memory
    offset: "int | tuple"   # in the descriptor, or ((address, length), ...) in the caller's memory
    length: int
    mode: int = 0o644


def _copy(src, dst: int, offset: int, length: int) -> int:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the start of ``dst`` (worker thread)."""
    if src.fd is None:                  # no descriptor (the caller's memory): through a buffer
        return _copy_summed(src, dst, offset, length, None)[0]
    os.lseek(dst, 0, os.SEEK_SET)
    done = 0
    while done < length:
        n = os.sendfile(dst, src.fd, offset + done, min(_COPY_CHUNK, length - done))
        if n == 0:
            break
        done += n
    return done


_piece = threading.local()


def _copy_summed(src, dst: int, offset: int, length: int, chunk: int | None) -> tuple[int, tuple | None, bytes]:
    """:func:`_copy` that also checksums what it copies, in one pass: each piece is read into
    this thread's buffer, summed while it is in the CPU cache, and written from that same
    buffer, so the sums are of exactly the bytes stored (the caller may change its source
    meanwhile). Returns (bytes copied, ``checksum.summarize`` of them -- None without ``chunk``
    --, the first ``sniff.HEAD`` bytes).
    ``src``: a CallerFile or CallerMemory (``offset``: in the file, or the memory's ranges)."""
    buf = getattr(_piece, "buf", None)
    if buf is None:
        buf = _piece.buf = memoryview(bytearray(_PIECE))
    summer = checksum.Summer(chunk, length) if chunk else None
    done, head = 0, b""
    while done < length:
        n = src.readinto(buf[:min(_PIECE, length - done)], offset, done)
        if n == 0:
            break
        if summer is not None:
            summer.update(buf[:n])
        if not done:
            head = bytes(buf[:min(n, HEAD)])
        w = 0
        while w < n:
            w += os.pwrite(dst, buf[w:n], done + w)
        done += n
    return done, summer.result() if summer is not None else None, head


class Commits:
    """The batched commit (see the module docstring): over ``files`` (the temp file's handle,
    its buffer and seal) and ``names`` (its rename, a replaced file's release)."""

    def __init__(self, index: Index, store: ObjectStore, ns: Namespace, files: FileHandles, names: NameOps,
                 spill_dir):
        self.index = index
        self.store = store
        self.ns = ns
        self.files = files
        self.names = names
        self.spill_dir = spill_dir
        self.telemetry = store.telemetry
        # (parent, name) of a published file: a shared volume publishes the name
        self.on_renamed: Callable[[int, bytes], Awaitable[None]] | None = None

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
            if not stat.S_ISDIR(rec.mode):
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
        if not stat.S_ISDIR(prec.mode):
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
            if orec is not None and stat.S_ISDIR(orec.mode):
                raise _err(errno.EISDIR)
            if (orec is not None and prec.mode & stat.S_ISVTX and cred.uid != 0
                    and cred.uid not in (orec.uid, prec.uid)):
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
                     chunk if m.fh is None else None, m.oid is not None)
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
                out.append(await self._finish(m, got, noreplace, quotas))
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
            if m.mapping is not None:       # made by the copy, never adopted
                m.mapping.close()
                m.mapping = None
            if m.fh in self.files.handles:
                if quotas is not None:
                    quotas.forget_handle(m.fh)
                await self.files.release(m.fh)
            if m.tmp is None:
                if m.staging is not None:   # not taken by a published object
                    m.staging.discard()
                    m.staging = None
            elif not m.published:
                try:
                    await self.names.unlink(m.parent, m.tmp)
                except NamespaceError:
                    pass

    async def _begin(self, e: CommitEntry, cred: Cred, quotas, noreplace: bool, dirmode: int | None = None,
                     dirs: list | None = None) -> "_Pending":
        """Checks, the (empty) buffer, and with a quota the hidden temp file and its room."""
        if type(e.offset) is int and e.offset < 0 or e.length < 0:
            raise _err(errno.EINVAL, "negative offset or length")
        if e.length > self.files.max_file_size():   # its reach is known: nothing is evicted for it
            raise _err(errno.EFBIG, f"{e.length} bytes: larger than the largest tier")
        parent, name = self.commit_parent(e.path, cred, noreplace, dirmode, dirs)
        if self._direct(quotas):
            return _Pending(e, parent, name, None, None, None, self.store.ram.new_staging(), cred=cred)
        tmp = TMP_PREFIX + os.urandom(8).hex().encode()
        fh, ino, _ = await self.files.create(parent, tmp, e.mode & 0o777, cred.uid, cred.gid, os.O_WRONLY)
        m = _Pending(e, parent, name, tmp, fh, ino, None)
        try:
            if quotas is not None and quotas.limits and e.length:
                await quotas.admit_write(fh, 0, e.length, whole=True)
            m.staging = await self.files.staging_of(self.files.handles[fh].ws)
        except BaseException:
            if quotas is not None:
                quotas.forget_handle(fh)
            await self.files.release(fh)
            try:
                await self.names.unlink(parent, tmp)
            except NamespaceError:
                pass
            raise
        return m

    def _direct(self, quotas) -> bool:
        """Entries are published directly (:meth:`_publish`) unless a quota must admit
        their bytes through a write handle (then: temp file, seal, rename)."""
        return quotas is None or not quotas.limits

    async def _publish(self, m: "_Pending", noreplace: bool, summary: tuple | None = None,
                       head: bytes | None = None) -> tuple[int, bytes]:
        """Seal the entry's buffer into an object and install it under its final name in one
        index transaction (Namespace.publish): no temp inode, no rename, one group commit.
        ``summary``, ``head``: the buffer's checksums and first bytes, taken by the copy that filled it."""
        staging, m.staging = m.staging, None
        ram = self.store.ram
        if ram.used > ram.capacity and not staging.spilled:     # as a write would (FileHandles.written)
            self.store.kick()
            await staging.spill(self.spill_dir)
        elif ram.used > ram.capacity * self.store.policy.high:
            self.store.kick()
        t0 = time.perf_counter()
        try:
            kv = await peek_block_header(staging, head)
            key = self.ns.path_of(m.parent).rstrip("/") + "/" + m.name.decode("utf-8", "surrogateescape")
            mapping, m.mapping = m.mapping, None
            obj = await self.store.create(self.index.new_id(b"ino"), staging, key, 1, summary, m.oid, mapping)
        finally:
            staging.discard()               # what the object did not adopt
        kvrec = {k: str(kv.get(k, "")) for k in ("namespace", "hash", "parent", "tokens")} if kv else None
        gone = self.names.describe_name(m.parent, m.name)
        try:
            _, dropped = self.ns.publish(m.parent, m.name, m.entry.mode, m.cred.uid, m.cred.gid, obj,
                                         kvrec, noreplace, self.files.is_open)
        except NamespaceError:
            with self.index.write() as txn:
                self.store.drop(txn, obj)
            await self.store.release_space(obj)
            raise
        m.published = True
        if dropped is not None:
            self.names.removed(dropped, gone)
            await self.store.release_space(dropped)
        self.telemetry.latency["seal"].observe(time.perf_counter() - t0)
        self.telemetry.events.emit("stored", obj, self.store.top_tier(obj), path=key, kv=kvrec or {})
        if self.on_renamed is not None:     # a shared volume publishes the name
            await self.on_renamed(m.parent, m.name)
        return m.parent, m.name

    async def _recopy(self, m: "_Pending"):
        """The copy of an entry into its tmpfs buffer ran out of room (space the RAM tier's
        accounting does not know of): the buffer spills to NVMe (kvfs.store.ramroom) and the
        bytes are copied again, into that file; the copy's result, as :func:`_copy_all`'s."""
        await ramroom.spill(m.staging, "a commit's copy ran out of room")
        chunk = self.store.chunk_size if m.fh is None else None
        job = (m.entry.src, m.staging.fd, m.entry.offset, m.entry.length, chunk, False)
        return (await trio.to_thread.run_sync(_copy_all, [job]))[0]

    def _copy_target(self, m: "_Pending") -> int | None:
        """The staging file the bytes are copied to; None: a buffer below the RAM tier's
        ``mapped_min`` stays in memory (the bytes are read, then written to it)."""
        staging = m.staging
        if staging.mem is not None and m.entry.length >= self.store.ram.mapped_min:
            if m.fh is None:                # published directly: the file is made as its object
                m.oid = self.index.new_id(b"oid")
            staging.to_file(m.oid)
        return staging.fd if staging.mem is None else None

    async def _finish(self, m: "_Pending", got, noreplace: bool, quotas=None) -> tuple[int, bytes]:
        """Account the copied bytes, seal as the last close would, rename over the name."""
        if isinstance(got, OSError) and got.errno == errno.ENOSPC and not m.staging.spilled:
            got = await self._recopy(m)     # the RAM tier's tmpfs was full: again, below it
        if isinstance(got, BaseException):
            raise got
        summary = head = None
        if isinstance(got, tuple):          # the copy's checksums of what it stored, its first
            got, summary, head, m.mapping = got     # bytes, the object's mapping (or None)
        staging = m.staging
        if isinstance(got, bytes):          # a small buffer kept in memory
            await staging.write(0, got)
            got = len(got)
        if got > staging.size:
            staging.account(got)
        if got != m.entry.length:
            raise _err(errno.EINVAL, f"the source holds {got} of the {m.entry.length} bytes named")
        if m.fh is None:
            return await self._publish(m, noreplace, summary, head)
        await self.files.written(self.files.handles[m.fh].ws, staging)
        await self.files.flush(m.fh)              # the seal: as the last close would
        if quotas is not None:              # _clean sees no handle after this release
            quotas.forget_handle(m.fh)
        await self.files.release(m.fh)
        rec = self.index.get_inode(m.ino)
        if rec is None or rec.oid is None:
            raise _err(errno.EIO, "the committed file was not sealed")
        await self.names.rename(m.parent, m.tmp, m.parent, m.name, 1 if noreplace else 0)
        m.published = True
        return m.parent, m.name


@dataclasses.dataclass
class _Pending:
    entry: CommitEntry
    parent: int
    name: bytes
    tmp: bytes | None           # None: published directly (:meth:`Commits._publish`), no temp file
    fh: int | None
    ino: int | None
    staging: object
    published: bool = False
    cred: Cred | None = None
    oid: int | None = None      # the object its buffer was made for (published directly, mapped)
    mapping: object = None      # that buffer's read-only mapping, made by the copy


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


def _mapped(fd: int, n: int) -> mmap.mmap | None:
    """A read-only mapping of the object's file, made here rather than in the trio thread;
    None if it cannot be made now (the tier then maps it, or keeps the bytes in memory)."""
    try:
        return mmap.mmap(fd, n, prot=mmap.PROT_READ)
    except OSError:
        return None


def _copy_all(jobs: list[tuple]) -> list:
    """Each ``(src, dst, offset, length, chunk, map)`` copied (worker thread): bytes copied,
    the bytes read when ``dst`` is None, or the error; with a ``chunk`` size, a tuple of that,
    the checksums of the copy (``checksum.summarize``, taken while the bytes are in cache), its
    first bytes, and with ``map`` a read-only mapping of ``dst`` (else None)."""
    out: list = []
    for src, dst, off, n, chunk, mapit in jobs:
        try:
            if dst is None:
                data = src.read(off, n)
                out.append(data if chunk is None else (data, checksum.summarize(memoryview(data), chunk), data[:HEAD], None))
            elif chunk is None:
                out.append(_copy(src, dst, off, n))
            else:
                got = _copy_summed(src, dst, off, n, chunk)
                out.append(got + (_mapped(dst, n) if mapit and got[0] == n else None,))
        except OSError as e:
            out.append(e)
    return out