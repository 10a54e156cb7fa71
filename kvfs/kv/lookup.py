"""Longest cached prefix of a block chain, in one round trip to the daemon.

On a kvfs mount, ``<mount>/.kvfs/lookup`` is a control file: ``pwrite`` at offset 0 a request
(UTF-8, newline-separated paths in chain order; a first line ``\0base DIR`` makes them
relative to DIR, itself relative to the mount root, so a chain is sent as
``<h[:2]>/<h>.kv`` names of one namespace directory), then ``pread`` returns
``{"prefix": k, "tiers": [...]}``: ``k`` leading paths exist as sealed regular files. A
further write at offset 0 starts a new request, so one fd serves a KVCache for its lifetime.
(The kernel may split a large write into several FUSE writes; those arrive at offsets > 0
and continue the same request.) The grammar is in ``kvfs/fs/control.py``.

Elsewhere (a plain directory) the fallback is one ``stat`` per block from the start until
the first miss: chains are prefix-closed when written, but eviction may remove tails (and
in principle any block), so the first miss ends the prefix.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading

from kvfs.protocol import CONTROL_NAME, LOOKUP_FILE, request

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20


def transact(fd: int, req: bytes) -> bytes:
    """Write a request at offset 0 of a control file and read the whole answer."""
    view = memoryview(req)
    done = 0
    while done < len(req):
        done += os.pwrite(fd, view[done:], done)
    parts = []
    off = 0
    while True:
        chunk = os.pread(fd, READ_CHUNK, off)
        parts.append(chunk)
        off += len(chunk)
        if len(chunk) < READ_CHUNK:
            break
    return b"".join(parts)


def find_control(path: str) -> tuple[str, str] | None:
    """``(mount_root, lookup_file)`` if ``path`` is inside a kvfs mount, else None.

    Walks up from ``path`` to the mount point of its filesystem looking for
    ``.kvfs/lookup``.
    """
    cur = os.path.realpath(path)
    while True:
        candidate = os.path.join(cur, CONTROL_NAME, LOOKUP_FILE)
        try:
            st = os.stat(candidate)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            return cur, candidate
        parent = os.path.dirname(cur)
        if os.path.ismount(cur) or parent == cur:
            return None
        cur = parent


def makedirs_on_mount(mount_root: str, path: str) -> int:
    """Make ``path`` (inside ``mount_root``) through a descriptor of the mount's root, so a
    mount that goes away meanwhile fails (ENOTCONN) instead of the directories landing under
    the bare mount point; returns the mount's st_dev."""
    fd = os.open(mount_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.stat(os.path.join(CONTROL_NAME, LOOKUP_FILE), dir_fd=fd)   # the kvfs mount, not what is under it
        rel = os.path.relpath(os.path.realpath(path), mount_root)
        parts = [] if rel == os.curdir else rel.split(os.sep)
        for k in range(1, len(parts) + 1):
            try:
                os.mkdir(os.path.join(*parts[:k]), dir_fd=fd)
            except FileExistsError:
                pass
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def open_mount_root(mount_root: str) -> int:
    """A descriptor of the kvfs mount's root, checked through itself (its ``.kvfs/lookup``):
    whatever is made, read or renamed relative to it stays on that mount -- ENOTCONN once its
    daemon is gone -- never under the bare mount point a dead mount leaves (the check of a
    path and the act by the same path would leave that window open). ENOTCONN (an OSError)
    when the path no longer leads to a kvfs mount."""
    fd = os.open(mount_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.stat(os.path.join(CONTROL_NAME, LOOKUP_FILE), dir_fd=fd).st_mode):
            raise FileNotFoundError
    except FileNotFoundError:
        os.close(fd)
        raise OSError(errno.ENOTCONN, f"{mount_root} is not a kvfs mount (any more)") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_at(root: int | None, tmp: str, final: str, data) -> None:
    """Write ``data`` (bytes, or a list of buffers written with one ``writev``) to the new file
    ``tmp`` and rename it over ``final`` (both relative to the directory descriptor ``root``;
    None: to the working directory)."""
    from kvfs.kv.blockio import write_all     # here: blockio imports the layout, which imports us
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=root)
    try:
        write_all(fd, data if isinstance(data, list) else [data])
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=root)
        raise
    os.close(fd)
    os.rename(tmp, final, src_dir_fd=root, dst_dir_fd=root)


def makedirs_under(mount_root: str | None, path: str) -> int:
    """Make ``path`` and its parents: through the mount's root (:func:`makedirs_on_mount`)
    when ``mount_root`` is a kvfs mount's, with ``os.makedirs`` when it is None (a plain
    directory); returns the st_dev of the filesystem they were made on."""
    if mount_root is not None:
        return makedirs_on_mount(mount_root, path)
    os.makedirs(path, exist_ok=True)
    return os.stat(path).st_dev


class PrefixLookup:
    """Answers "how many leading blocks of this chain are cached?" for one cache root."""

    def __init__(self, root: str, *, use_control: bool = True):
        self.root = os.path.realpath(root)
        ctl = find_control(self.root) if use_control else None
        self._lock = threading.Lock()
        self._fd = -1
        self.base = ""
        if ctl is not None:
            self.mount_root, path = ctl
            self._fd = os.open(path, os.O_RDWR)
            self.base = os.path.relpath(self.root, self.mount_root)
            log.debug("prefix lookups through %s", path)
        else:
            self.mount_root = None

    def fileno(self) -> int:
        """The lookup control file's descriptor (-1: a plain directory)."""
        return self._fd

    @property
    def one_call(self) -> bool:
        """True when lookups go to the daemon in one call (a kvfs mount)."""
        return self._fd >= 0

    def prefix(self, paths: list[str]) -> int:
        """Number of leading ``paths`` (absolute, in chain order) that exist as block files."""
        if not paths:
            return 0
        if self._fd >= 0:
            try:
                return self._query(paths)[0]
            except OSError as e:
                log.warning("lookup control file failed (%s); falling back to stat", e)
        return self._prefix_stat(paths)

    def tiers(self, paths: list[str]) -> tuple[int, list]:
        """``(prefix, tiers)``: the daemon's answer (tiers empty without a mount)."""
        if self._fd >= 0 and paths:
            return self._query(paths)
        return self._prefix_stat(paths), []

    def prefix_rel(self, rels: list[str]) -> int:
        """Like ``prefix`` for paths relative to ``root`` (e.g. ``<h[:2]>/<h>.kv``)."""
        if not rels:
            return 0
        if self._fd >= 0:
            try:
                return self._send(request(self.base, rels), len(rels))[0]
            except OSError as e:
                log.warning("lookup control file failed (%s); falling back to stat", e)
        return self._prefix_stat([os.path.join(self.root, r) for r in rels])

    def tiers_rel(self, rels: list[str]) -> tuple[int, list]:
        """``(prefix, tiers)`` for paths relative to ``root`` (tiers empty without a mount)."""
        if self._fd >= 0 and rels:
            return self._send(request(self.base, rels), len(rels))
        return self._prefix_stat([os.path.join(self.root, r) for r in rels]), []

    def _query(self, paths: list[str]) -> tuple[int, list]:
        head = self.root + os.sep
        if all(p.startswith(head) for p in paths):
            n = len(head)
            return self._send(request(self.base, [p[n:] for p in paths]), len(paths))
        return self._send(request("", [os.path.relpath(p, self.mount_root) for p in paths]), len(paths))

    def _send(self, req: bytes, n: int) -> tuple[int, list]:
        with self._lock:
            raw = transact(self._fd, req)
        try:
            answer = json.loads(raw)
            k = int(answer["prefix"])
        except (ValueError, KeyError, TypeError) as e:
            raise OSError(f"bad lookup answer {raw[:200]!r}: {e}") from None
        if not 0 <= k <= n:
            raise OSError(f"lookup answered prefix {k} for {n} paths")
        return k, list(answer.get("tiers", []))

    @staticmethod
    def _prefix_stat(paths: list[str]) -> int:
        for i, p in enumerate(paths):
            try:
                st = os.stat(p)
            except (FileNotFoundError, NotADirectoryError):
                return i
            if not stat.S_ISREG(st.st_mode):
                return i
        return len(paths)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
