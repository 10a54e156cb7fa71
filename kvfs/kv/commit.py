"""Client of ``.kvfs/commit`` (kvfs/fs/commitctl.py): write many files in one request.

:class:`CommitClient` names each file's bytes in one request and the daemon copies them into
its store and publishes each file as close+rename would. A file held in writable buffers
is named by its address(es) (``\\0mem``: the daemon reads this process's memory, one copy);
other files' bytes (read-only or empty buffers, or a daemon that does not read memory) are
first copied into a memfd of the client's own, at consecutive offsets, and named there.
The buffers must not change until :meth:`CommitClient.commit` returns (a write(2) of them
would have the same rule). Two FUSE round trips per batch (write the
request, read the answer) instead of create, write(s), flush, release and rename per file.

A batch larger than ``2 * PIPELINE_BYTES`` goes as several requests on two descriptors of
the control file, each with its memfd: while the daemon copies one part, this thread writes
the next into the other memfd (a helper thread of the client waits for the answers; every
answer is in before ``commit`` returns).

Not thread-safe: one client per thread (its memfds are reused from batch to batch; the daemon
has its own copy once ``commit`` returns).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import json
import logging
import os

from kvfs import protocol
from kvfs.kv.blockio import write_all

log = logging.getLogger(__name__)

BATCH_BYTES = 256 << 20      # a larger batch goes as several requests
PIPELINE_BYTES = 32 << 20    # parts of a batch over twice this: copied while the last is served
_ANSWER_CHUNK = 1 << 20
_IOV = 1024                  # buffers per pwritev (IOV_MAX)


# an entry named by address that failed for a reason of the memory read itself: sent again by memfd
# (EXDEV: a range mapped from a file of the mount itself, which the daemon never reads)
_REFUSED_MEMORY = (errno.EPERM, errno.ENOSYS, errno.EFAULT, errno.EXDEV)


class CommitUnavailable(OSError):
    """The mount has no ``.kvfs/commit`` (an older daemon), or it refused the request."""


def _views(bufs) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in bufs]


def _address(v: memoryview) -> int | None:
    """Where a writable, non-empty buffer starts in this process's memory; None for others."""
    if not len(v) or v.readonly:
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(v))
    except (TypeError, ValueError):
        return None


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would race other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


class CommitClient:
    """Holds a descriptor of the mount's root: the control file is opened through it, and
    so are the directories it makes (:meth:`makedirs`), so a mount that dies meanwhile fails
    them (ENOTCONN) instead of letting them land under the bare mount point."""

    def __init__(self, mount_root: str):
        self._rel = os.path.join(protocol.CONTROL_NAME, protocol.COMMIT_FILE)
        self.root = os.open(mount_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.ctl = os.open(self._rel, os.O_RDWR | os.O_CLOEXEC, dir_fd=self.root)
        except BaseException as e:
            os.close(self.root)
            if isinstance(e, FileNotFoundError):
                raise CommitUnavailable(errno.ENOTSUP, f"{mount_root}/{self._rel} does not exist (older kvfs)") from None
            raise
        self.memfd = os.memfd_create("kvfs-commit", os.MFD_CLOEXEC)
        self._lanes = [_Lane(self.ctl, self.memfd)]
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None
        self._mkdir = True              # the daemon makes missing directories (\0mkdir)
        self.use_memory = True          # name buffers by address (\0mem) while the daemon reads them

    @classmethod
    def open(cls, mount_root: str) -> "CommitClient | None":
        try:
            return cls(mount_root)
        except OSError as e:            # no commit file (older kvfs), or refused (ESRCH, ...)
            log.debug("no batched commit under %s: %s", mount_root, e)
            return None

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
            self._waiter = None
        for fd in [fd for lane in self._lanes[1:] for fd in (lane.ctl, lane.memfd)] + [self.ctl, self.memfd, self.root]:
            if fd >= 0:
                try:
                    os.close(fd)        # the descriptor is closed even when this fails
                except OSError as e:    # ENOTCONN: the mount is gone
                    log.debug("closing a commit descriptor: %s", e)
        self.ctl = self.memfd = self.root = -1
        self._lanes = []

    def makedirs(self, rel: str) -> None:
        """``mkdir -p`` of ``rel`` (relative to the mount root) through the root's descriptor:
        ENOTCONN (an OSError) once the mount is gone, never a directory under the bare mount point.
        The deepest directory is tried first (usually the only one missing: one round trip)."""
        parts = [p for p in rel.split(os.sep) if p not in ("", os.curdir)]
        k = len(parts)
        while k:
            try:
                os.mkdir(os.path.join(*parts[:k]), dir_fd=self.root)
                break
            except FileExistsError:
                break
            except FileNotFoundError:
                k -= 1                      # its parent is missing too
        for j in range(k + 1, len(parts) + 1):
            try:
                os.mkdir(os.path.join(*parts[:j]), dir_fd=self.root)
            except FileExistsError:
                pass

    def commit(self, base: str, items: list[tuple[str, list]], mode: int | None = None,
               noreplace: bool = False, dirmode: int | None = None) -> list[int]:
        """Publish ``items`` (``(path relative to base, [buffers in file order])``) under
        ``base`` (relative to the mount root). Returns one errno per item (0: published;
        EEXIST: ``noreplace`` and the file exists, kept as it was). ``dirmode``: missing
        directories are made by the daemon with these bits (else: ENOENT for the item).
        Raises OSError when the request as a whole failed (daemon gone, refused)."""
        parts, start, size = [], 0, 0
        total = sum(memoryview(b).nbytes for _, bufs in items for b in bufs)
        limit = PIPELINE_BYTES if total > 2 * PIPELINE_BYTES else BATCH_BYTES
        for i, (_, bufs) in enumerate(items):
            n = sum(memoryview(b).nbytes for b in bufs)
            if size and size + n > limit:
                parts.append(items[start:i])
                start, size = i, 0
            size += n
        if start < len(items):
            parts.append(items[start:])
        if not items:
            return []
        memory = self.use_memory
        try:
            results = (self._commit(base, items, mode, noreplace, dirmode) if len(parts) < 2
                       else self._pipelined(base, parts, mode, noreplace, dirmode))
        except OSError as e:
            if not (memory and e.errno == errno.EINVAL):
                raise
            log.debug("the daemon does not read this process's memory (%s): copying through a memfd", e)
            self.use_memory = False     # an older daemon: \0mem does not parse
            return self.commit(base, items, mode, noreplace, dirmode)
        again = [k for k, r in enumerate(results) if memory and r in _REFUSED_MEMORY]
        if again:                       # refused the memory read (not dumpable, ...)? by memfd
            mapped = all(results[k] == errno.EXDEV for k in again)   # only those buffers: keep \0mem
            self.use_memory = False
            retried = self.commit(base, [items[k] for k in again], mode, noreplace, dirmode)
            if mapped:
                self.use_memory = True
            elif any(r in (0, errno.EEXIST) for r in retried):
                log.debug("the daemon refused to read this process's memory (%s): copying through a memfd",
                          os.strerror(results[again[0]]))
            else:                       # refused for the entry's own sake (a path it may not write)
                self.use_memory = True
            for k, r in zip(again, retried):
                results[k] = r
        return results

    def _pipelined(self, base: str, parts: list, mode: int | None, noreplace: bool,
                   dirmode: int | None) -> list[int]:
        """Each part in its own request, alternating between two lanes: part k+1 is written to
        its memfd while the daemon serves part k (its answer awaited by the helper thread)."""
        if len(self._lanes) < 2:
            ctl = os.open(self._rel, os.O_RDWR | os.O_CLOEXEC, dir_fd=self.root)
            self._lanes.append(_Lane(ctl, os.memfd_create("kvfs-commit", os.MFD_CLOEXEC)))
        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvfs-commit-answer")
        out: list[int] = []
        inflight: list = []         # futures of the answers, oldest first
        try:
            for k, part in enumerate(parts):
                lane = self._lanes[k % 2]           # its last request's answer is in (below)
                self._send(lane, base, part, mode, noreplace, dirmode)
                inflight.append(self._waiter.submit(self._answer, lane, len(part)))
                if len(inflight) == 2:
                    out += inflight.pop(0).result()
            while inflight:
                out += inflight.pop(0).result()
        finally:
            for f in inflight:      # a failed part: the others are awaited (their memfds in use)
                concurrent.futures.wait([f])
        return out

    def commit_into(self, base: str, items: list[tuple[str, list]], noreplace: bool = False) -> list[int]:
        """:meth:`commit` under ``base``, missing subdirectories made as ``os.makedirs`` would
        (by the daemon in the same request; with a daemon that does not know ``\\0mkdir``,
        items refused with ENOENT are sent again once :meth:`makedirs` made them)."""
        if self._mkdir:
            try:
                return self.commit(base, items, noreplace=noreplace, dirmode=0o777 & ~_umask())
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.debug("the daemon does not make directories on commit: making them here")
                self._mkdir = False
        results = self.commit(base, items, noreplace=noreplace)
        nodir = [k for k, r in enumerate(results) if r == errno.ENOENT and os.path.dirname(items[k][0])]
        if nodir:
            for sub in {os.path.dirname(items[k][0]) for k in nodir}:
                self.makedirs(os.path.join(base, sub))
            for k, r in zip(nodir, self.commit(base, [items[k] for k in nodir], noreplace=noreplace)):
                results[k] = r
        return results

    def _commit(self, base: str, items: list[tuple[str, list]], mode: int | None, noreplace: bool,
                dirmode: int | None = None) -> list[int]:
        lane = self._lanes[0]
        self._send(lane, base, items, mode, noreplace, dirmode)
        return self._answer(lane, len(items))

    def _send(self, lane: "_Lane", base: str, items: list[tuple[str, list]], mode: int | None,
              noreplace: bool, dirmode: int | None) -> None:
        """Name each item by address (one writable buffer, :attr:`use_memory`), or copy its
        bytes into the lane's memfd, back to back; then write the request."""
        entries, views, in_memory, off = [], [], [], 0
        for name, bufs in items:
            vs = _views(bufs)
            n = sum(len(v) for v in vs)
            at = self._ranges(vs) if self.use_memory else None
            if at is not None:
                entries.append((at, n, name))
                lane.pinned += vs           # the daemon reads them: alive until the answer
            else:
                entries.append((off, n, name))
                views += vs
                off += n
            in_memory.append(at is not None)
        if off > lane.size:
            os.ftruncate(lane.memfd, off)
            lane.size = off
        at = 0
        for k in range(0, len(views), _IOV):        # the entries lie back to back: few pwritev
            at += write_all(lane.memfd, views[k:k + _IOV], at)
        req = protocol.commit_request(base, lane.memfd, entries, mode, noreplace, dirmode, in_memory)
        done = 0
        while done < len(req):
            done += os.pwrite(lane.ctl, req[done:done + (1 << 20)], done)

    def _answer(self, lane: "_Lane", count: int) -> list[int]:
        """Read the answer to the lane's request (the daemon serves it now): one errno per item."""
        try:
            return self._read_answer(lane, count)
        finally:
            lane.pinned.clear()

    @staticmethod
    def _ranges(vs: list[memoryview]) -> str | int | None:
        """An item's OFFSET field by address: one buffer's address, ``ADDR+LEN,...`` for
        several (neighbours merged); None when a buffer is read-only or empty (the memfd)."""
        spans: list[list[int]] = []
        for v in vs:
            at = _address(v)
            if at is None:
                return None
            if spans and spans[-1][0] + spans[-1][1] == at:
                spans[-1][1] += len(v)
            else:
                spans.append([at, len(v)])
        if not spans or len(spans) > protocol.COMMIT_MAX_RANGES:
            return None
        return spans[0][0] if len(spans) == 1 else ",".join(f"{a}+{k}" for a, k in spans)

    def _read_answer(self, lane: "_Lane", count: int) -> list[int]:
        parts, off = [], 0
        while True:
            b = os.pread(lane.ctl, _ANSWER_CHUNK, off)
            if not b:
                break
            parts.append(b)
            off += len(b)
            if b.endswith(b"\n"):
                break
        answer = b"".join(parts)
        try:
            results = json.loads(answer)["results"]
        except (ValueError, KeyError, TypeError):
            raise OSError(errno.EPROTO, f"bad commit answer {answer[:200]!r}") from None
        if len(results) != count or not all(isinstance(r, int) for r in results):
            raise OSError(errno.EPROTO, "commit answer does not match the request")
        return results


class _Lane:
    """A descriptor of the control file and the memfd its requests name."""

    def __init__(self, ctl: int, memfd: int):
        self.ctl, self.memfd, self.size = ctl, memfd, 0
        self.pinned: list[memoryview] = []      # buffers named by address in the request in flight
