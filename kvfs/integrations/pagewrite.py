"""PageStore's write path (a mixin of kvfs.integrations.pages.PageStore): pages not yet
present go in one ``.kvfs/commit`` request per batch (kvfs.kv.commit), or through the mount
(temp file, one ``writev``, ``rename``) where the daemon has no commit file or refused a page."""
from __future__ import annotations

import contextlib
import errno
import logging
import os

from kvfs.kv.blockio import write_all
from kvfs.kv.commit import CommitClient
from kvfs.kv.lookup import open_mount_root

log = logging.getLogger("kvfs.integrations.pages")


class PageWrites:
    """``write_many`` and its helpers; the state (``dir``, ``_local``, counters, ...) is PageStore's."""

    @property
    def mount_root(self) -> str | None:
        """The root of the kvfs mount this store is on (None: a plain directory)."""
        self._connect()
        return self._mount_root

    def write_many(self, names: list[str], bufs_of) -> list[bool]:
        """Store pages ``names`` (``bufs_of(i)``: page i's buffers), skipping the leading ones
        present; the rest by commit or through the mount. True per page stored or present."""
        n = len(names)
        if not n:
            return []
        ok = [False] * n
        present = self.prefix(names)
        written = nbytes = failed = 0
        for i in range(present):
            ok[i] = True
        todo = list(range(present, n))
        memo: dict[int, list] = {}

        def bufs_at(i: int) -> list:
            if i not in memo:
                memo[i] = bufs_of(i)
            return memo[i]
        try:
            with self._call() as progress:
                todo = self._commit(names, bufs_at, todo, ok)
                for i in todo:
                    self._write(names[i], bufs_at(i))
                    ok[i] = True
                    progress()
        except Exception as e:         # noqa: BLE001 -- a failed store is reported, not raised
            self._failed("write", e, sum(1 for i in range(present, n) if not ok[i]))
        for i in range(present, n):
            if ok[i]:
                written += 1
                nbytes += sum(memoryview(b).nbytes for b in bufs_at(i))
            else:
                failed += 1
        self._count(sets=n, written=written, skipped=present, set_failures=failed, bytes_written=nbytes)
        return ok

    def _commit(self, names: list[str], bufs_of, todo: list[int], ok: list[bool]) -> list[int]:
        """Publish pages ``todo`` by commit (this thread's client); returns those left for the mount."""
        st = self._local
        if not todo or not self._connect().one_call or not self.use_commit:
            return todo
        if getattr(st, "commit_epoch", -1) != self._epoch:
            st.committer, st.commit_epoch = CommitClient.open(self._mount_root), self._epoch
            if st.committer is not None:
                with self._lock:
                    self._leases.append(st.committer)     # closed with the lease descriptors
        if st.committer is None:
            return todo
        try:
            results = st.committer.commit_into(os.path.relpath(self.dir, self._mount_root),
                                                 [(names[i], bufs_of(i)) for i in todo], noreplace=True)
        except OSError as e:
            if e.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.ENODEV):
                raise                       # the daemon is gone: these pages fail
            log.warning("kvfs commit refused (%s): %s writes through the mount from now on", e, self.dir)
            self.use_commit = False
            return todo
        left = []
        for i, r in zip(todo, results):
            if r in (0, errno.EEXIST):      # stored, or present already (a page never changes)
                ok[i] = True
            else:
                self._count(commit_refused=1)
                log.debug("commit of %s refused (%s): through the mount", names[i], os.strerror(r))
                left.append(i)
        return left

    def _write(self, name: str, bufs: list) -> int:
        if self.require_kvfs:
            self._connect()             # never write under an unmounted mount point
        mount_root = self._mount_root
        # on a mount: every step relative to a descriptor of its root, checked through itself,
        # so a mount that dies after the check above fails (ENOTCONN) instead of the temp file
        # and its directories landing under the bare mount point
        at = open_mount_root(mount_root) if mount_root is not None else None
        try:
            top = self.dir if at is None else os.path.relpath(os.path.realpath(self.dir), mount_root)
            final = os.path.normpath(os.path.join(top, name))
            sub, base = os.path.split(final)
            tmp = os.path.join(sub, f".{base}.{os.urandom(6).hex()}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=at)
            except FileNotFoundError:
                if sub == os.path.normpath(top):
                    raise
                _makedirs(at, sub)              # names with subdirectories (vLLM's fs layout)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=at)
            try:
                total = write_all(fd, bufs)
                os.close(fd)
                fd = -1
                os.rename(tmp, final, src_dir_fd=at, dst_dir_fd=at)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=at)
                raise
        finally:
            if at is not None:
                os.close(at)
        return total


def _makedirs(at: int | None, path: str) -> None:
    """``mkdir -p`` of ``path`` (relative to the directory descriptor ``at``; None: as is)."""
    if at is None:
        os.makedirs(path, exist_ok=True)
        return
    parts = [p for p in path.split(os.sep) if p not in ("", os.curdir)]
    for k in range(1, len(parts) + 1):
        with contextlib.suppress(FileExistsError):
            os.mkdir(os.path.join(*parts[:k]), dir_fd=at)
