"""Client of ``.kvfs/commit`` (kvfs/fs/commitctl.py): write many files in one request.

:class:`CommitClient` copies each file's bytes into a memfd of its own, at consecutive
offsets, and names them all in one request; the daemon copies them into its store and
publishes each file as close+rename would. Two FUSE round trips per batch (write the
request, read the answer) instead of create, write(s), flush, release and rename per file.

Not thread-safe: one client per thread (its memfd is reused from batch to batch; the daemon
has its own copy once ``commit`` returns).
"""
from __future__ import annotations

import errno
import json
import logging
import os

from kvfs import protocol
from kvfs.kv.blockio import write_all

log = logging.getLogger(__name__)

BATCH_BYTES = 256 << 20      # a larger batch goes as several requests
_ANSWER_CHUNK = 1 << 20
_IOV = 1024                  # buffers per pwritev (IOV_MAX)


class CommitUnavailable(OSError):
    """The mount has no ``.kvfs/commit`` (an older daemon), or it refused the request."""


def _views(bufs) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in bufs]


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
        rel = os.path.join(protocol.CONTROL_NAME, protocol.COMMIT_FILE)
        self.root = os.open(mount_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.ctl = os.open(rel, os.O_RDWR | os.O_CLOEXEC, dir_fd=self.root)
        except BaseException as e:
            os.close(self.root)
            if isinstance(e, FileNotFoundError):
                raise CommitUnavailable(errno.ENOTSUP, f"{mount_root}/{rel} does not exist (older kvfs)") from None
            raise
        self.memfd = os.memfd_create("kvfs-commit", os.MFD_CLOEXEC)
        self._size = 0
        self._mkdir = True              # the daemon makes missing directories (\0mkdir)

    @classmethod
    def open(cls, mount_root: str) -> "CommitClient | None":
        try:
            return cls(mount_root)
        except OSError as e:            # no commit file (older kvfs), or refused (ESRCH, ...)
            log.debug("no batched commit under %s: %s", mount_root, e)
            return None

    def close(self) -> None:
        for fd in (self.ctl, self.memfd, self.root):
            if fd >= 0:
                try:
                    os.close(fd)        # the descriptor is closed even when this fails
                except OSError as e:    # ENOTCONN: the mount is gone
                    log.debug("closing a commit descriptor: %s", e)
        self.ctl = self.memfd = self.root = -1

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
        out: list[int] = []
        start, size = 0, 0
        for i, (_, bufs) in enumerate(items):
            n = sum(memoryview(b).nbytes for b in bufs)
            if size and size + n > BATCH_BYTES:
                out += self._commit(base, items[start:i], mode, noreplace, dirmode)
                start, size = i, 0
            size += n
        if start < len(items):
            out += self._commit(base, items[start:], mode, noreplace, dirmode)
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
        entries, views, off = [], [], 0
        for name, bufs in items:
            vs = _views(bufs)
            n = sum(len(v) for v in vs)
            entries.append((off, n, name))
            views += vs
            off += n
        if off > self._size:
            os.ftruncate(self.memfd, off)
            self._size = off
        at = 0
        for k in range(0, len(views), _IOV):        # the entries lie back to back: few pwritev
            at += write_all(self.memfd, views[k:k + _IOV], at)
        req = protocol.commit_request(base, self.memfd, entries, mode, noreplace, dirmode)
        self._send(req)
        answer = self._receive()
        try:
            results = json.loads(answer)["results"]
        except (ValueError, KeyError, TypeError):
            raise OSError(errno.EPROTO, f"bad commit answer {answer[:200]!r}") from None
        if len(results) != len(items) or not all(isinstance(r, int) for r in results):
            raise OSError(errno.EPROTO, "commit answer does not match the request")
        return results

    def _send(self, req: bytes) -> None:
        done = 0
        while done < len(req):
            done += os.pwrite(self.ctl, req[done:done + (1 << 20)], done)

    def _receive(self) -> bytes:
        parts, off = [], 0
        while True:
            b = os.pread(self.ctl, _ANSWER_CHUNK, off)
            if not b:
                break
            parts.append(b)
            off += len(b)
            if b.endswith(b"\n"):
                break
        return b"".join(parts)
