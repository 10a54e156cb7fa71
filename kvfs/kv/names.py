"""The client side of the name table (kvfs.store.names): "is this entry absent?" answered
from shared memory, without a FUSE round trip.

:meth:`NameView.absent` is True only when the table says so and stayed the same table (same
live generation) across the probe: then the entry did not exist at that instant, because the
daemon adds an entry before it becomes visible and removes it after it is gone. False means
"ask the filesystem" (present, or the table is not usable: missing, another version, another
mount, replaced). A view remaps itself when the daemon replaced the table (it grew); one that
cannot be used stays off until :meth:`reset`. A table not advertised yet (the daemon builds it
after the mount is ready) is asked for again at most every RETRY seconds; until then: lookups.

:meth:`NameView.absent_in` needs the inode of the directory (and of each subdirectory of a name
like vLLM's ``abc/de_g0/<hash>.bin``). It keeps them per path, with no system call, while a
version-2 table vouches for them: its count of removed directories (H_DIRS) is what it was
before the ``stat`` that gave the inode, both before and after the probe. What the table cannot
see -- the mount going (a killed daemon, a lazy unmount, another mount at the path), a symlink
outside the mount changing -- a ``stat`` of the directory catches, at most ``revalidate``
seconds after the last one: it must still be on the mount's device (``dev``), with that inode.
A crashed daemon's successor marks its table stale when it starts (kvfs.store.names.retire).
"""
from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import time

from kvfs.protocol import (CONTROL_NAME, H_CAPACITY, H_DIRS, H_GENERATION, H_MAGIC, H_RUN, H_VERSION,
                           NAMES_BUILDING_KEY, NAMES_EMPTY, NAMES_HEADER, NAMES_MAGIC, NAMES_STALE, NAMES_STATS_KEY,
                           NAMES_VERSIONS, STATS_FILE, names_hash, names_hash_key)

log = logging.getLogger(__name__)

_REMAPS = 4         # tries to map a current table in one call (each replacement is a rebuild)
RETRY = 1.0         # seconds before asking .kvfs/stats again for a table not advertised (being built)
_MAX_DIRS = 4096    # cached directory inodes per view (dropped all at once beyond)
REVALIDATE = 1.0    # seconds a cached directory inode is used before a stat checks it again


def _slot_state(w: memoryview, h: int) -> bool | None:
    """One probe of the mapped table ``w`` for hash ``h``: True listed, False absent, None the
    table is stale or was replaced while we looked (map the current one)."""
    gen = w[H_GENERATION]
    if gen == NAMES_STALE:
        return None
    mask = w[H_CAPACITY] - 1
    i, v = h & mask, NAMES_EMPTY
    for _n in range(mask + 1):          # the writer always leaves empty slots
        v = w[NAMES_HEADER + i]
        if v == h or v == NAMES_EMPTY:
            break
        i = (i + 1) & mask
    if w[H_GENERATION] != gen or (v != h and v != NAMES_EMPTY):
        return None
    return v == h


class NameView:
    """A read-only view of the name table of the kvfs mount at ``mount_root``."""

    def __init__(self, mount_root: str, dev: int | None = None, stat=os.stat, revalidate: float | None = REVALIDATE):
        """``dev``: the mount's device number (a directory whose ``stat`` says another one is
        not answered from this table); ``stat``: the call that stats directories (PageStore's
        counts them and guards them against a stopped daemon); ``revalidate``: seconds between
        the ``stat``s of a cached directory (0: every call, as a version-1 table; None: only
        when the table says a directory went -- then a remount goes unseen)."""
        self.mount_root = mount_root
        self.dev = dev
        self.stat = stat
        self.revalidate_ns = None if revalidate is None else int(revalidate * 1e9)
        self.path: str | None = None
        self.run = 0
        self._map: mmap.mmap | None = None
        self._w: memoryview | None = None
        self._off = False
        self._retry_at = 0.0
        self.remaps = 0
        self.stats = 0              # directories stat-ed for their inode (0 per call when cached)
        self._inos: dict[str, tuple[int, int, int]] = {}    # directory -> (inode, H_DIRS, stat-ed at)

    def _discover(self) -> bool:
        with open(os.path.join(self.mount_root, CONTROL_NAME, STATS_FILE), "rb") as f:
            doc = json.loads(f.read())
        info = doc.get(NAMES_STATS_KEY)
        if not info:
            self._off = not doc.get(NAMES_BUILDING_KEY)    # none at all (e.g. a shared volume)
            return False
        self.path, self.run = str(info["path"]), int(info["run"])
        return True

    def _open(self) -> memoryview | None:
        """Map the table file and return its words; None if it is not the table of this
        mount's run. The caller uses what this returns, not ``self._w``: another thread of
        the view may forget the mapping at any time."""
        self._close_map()
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < 8 * NAMES_HEADER:
                return None
            m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        w = memoryview(m).cast("Q")
        cap = w[H_CAPACITY]
        if (w[H_MAGIC] != NAMES_MAGIC or w[H_VERSION] not in NAMES_VERSIONS or w[H_RUN] != self.run
                or cap == 0 or cap & (cap - 1) or len(w) < NAMES_HEADER + cap):
            w.release()
            m.close()
            return None
        self._map, self._w = m, w
        self.remaps += 1
        return w

    def _close_map(self) -> None:
        """Forget the mapping. Not released or closed here: another thread of the same view
        may be probing it (PageStore is shared by the runtime's threads); the last reference
        dropped unmaps it."""
        self._w = self._map = None

    def absent(self, parent_ino: int, name: bytes, nonblocking: bool = False) -> bool:
        """True: the entry ``name`` of directory ``parent_ino`` does not exist (now). False:
        ask the filesystem. Never raises. ``nonblocking``: nothing that may wait on the daemon
        (a table not discovered yet: False)."""
        return self.state(parent_ino, name, nonblocking) is False

    def state(self, parent_ino: int, name: bytes, nonblocking: bool = False) -> bool | None:
        """What the table says of the entry ``name`` of ``parent_ino``: False absent (then it
        is), True listed (it exists, unless a removal is being applied or two names share a
        hash: a reader of it must still treat ENOENT as a miss), None not known (ask the
        filesystem). Never raises."""
        if self._off:
            return None
        try:
            return self._probe(names_hash(parent_ino, name), nonblocking)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.info("name table of %s not usable (%s: %s): using lookups", self.mount_root, type(e).__name__, e)
            self._off = True
            self._close_map()
            return None

    def absent_in(self, directory: str, name: str, parent: int | None = None, nonblocking: bool = False) -> bool:
        """``absent`` for the file ``name`` under ``directory`` (a path inside the mount; its
        inode ``parent`` if the caller has it). ``name`` may hold subdirectories: each is looked
        up in the table too, so a missing subdirectory is answered without a round trip. The
        inodes of the directories come from the cache the table vouches for, else ``stat``
        (``nonblocking``: no ``stat``, nothing else that may wait on the daemon: an inode not
        cached or due for its ``stat``, or a table not discovered yet, answers False)."""
        return self.state_in(directory, name, parent, nonblocking) is False

    def state_in(self, directory: str, name: str, parent: int | None = None,
                 nonblocking: bool = False) -> bool | None:
        """``state`` of the file ``name`` under ``directory`` (see :meth:`absent_in`): False
        absent, True listed (with every directory on the way), None not known."""
        if self._off:
            return None
        w = self._w
        if w is not None and parent is None and "/" not in name:
            st = self._cached_file_state(w, directory, name)
            if st is not None:
                return st
        mark = self._mark()
        nb = nonblocking
        try:
            if parent is None:
                parent = self._ino(directory, mark, nb)
            if "/" in name:
                path = directory
                *dirs, name = name.split("/")
                for part in dirs:
                    if not part or part == "." or part == "..":
                        return None     # not a plain relative path: ask the filesystem
                    st = self.state(parent, os.fsencode(part), nb)
                    if st is not True:
                        return st if st is None or self._held(mark) else None
                    path = os.path.join(path, part)
                    parent = self._ino(path, mark, nb)
            st = self.state(parent, name.encode("utf-8", "surrogateescape"), nb)
        except OSError:
            return None                 # the ordinary path answers (and counts) it
        return st if st is None or self._held(mark) else None

    def _cached_file_state(self, w: memoryview, directory: str, name: str) -> bool | None:
        """``state_in`` of a file of a cached directory, in one pass (the path of every "is this
        page here" of the adapters): the same checks as the general path -- the directory's
        inode cached under the current H_DIRS and fresh, the table's generation and H_DIRS the
        same after the probe -- or None: take the general path."""
        try:
            if w[H_VERSION] < 2:
                return None
            mark = w[H_DIRS]
            ino = self._cached_ino(directory, mark, time.monotonic_ns())
            if ino is None:
                return None
            st = _slot_state(w, names_hash_key(ino.to_bytes(8, "big") + name.encode("utf-8", "surrogateescape")))
            return st if w[H_DIRS] == mark else None
        except (ValueError, TypeError):         # released meanwhile
            return None

    def _mark(self) -> int | None:
        """H_DIRS now if the table vouches for cached inodes (mapped, version 2), else None."""
        w = self._w
        if w is None:
            return None
        try:
            return w[H_DIRS] if w[H_VERSION] >= 2 else None
        except (ValueError, TypeError):         # released meanwhile: not vouched
            return None

    def _held(self, mark: int | None) -> bool:
        """Cached inodes taken under ``mark`` still held after the probe (always, if none were)."""
        return mark is None or self._mark() == mark

    def _ino(self, path: str, mark: int | None, nonblocking: bool = False) -> int:
        """The inode of the directory ``path``: cached under ``mark``, else a ``stat`` (whose
        device must be ``dev``), then cached if ``mark`` (read before the ``stat``) vouches;
        ``nonblocking``: EAGAIN instead of the ``stat``."""
        now = time.monotonic_ns()
        if mark is not None:
            ino = self._cached_ino(path, mark, now)
            if ino is not None:
                return ino
        if nonblocking:
            raise OSError(errno.EAGAIN, f"{path}: inode not cached")
        self.stats += 1
        st = self.stat(path)
        if self.dev is not None and st.st_dev != self.dev:
            raise OSError(errno.EXDEV, f"{path} is not on the mount of this name table")
        if mark is not None:
            if len(self._inos) >= _MAX_DIRS:
                self._inos.clear()
            self._inos[path] = (st.st_ino, mark, now)
        return st.st_ino

    def _cached_ino(self, path: str, mark: int, now: int) -> int | None:
        """The inode of directory ``path`` if cached under ``mark`` and not due for its ``stat``."""
        c = self._inos.get(path)
        if c is not None and c[1] == mark and (self.revalidate_ns is None or now - c[2] < self.revalidate_ns):
            return c[0]
        return None

    def _probe(self, h: int, nonblocking: bool = False) -> bool | None:
        """Is hash ``h`` in the table (True), not in it (False), or not known (None)?"""
        for _ in range(_REMAPS):
            w = self._w
            if w is None:
                if self.path is None:
                    if nonblocking or time.monotonic() < self._retry_at:    # _discover reads .kvfs
                        return None
                    if not self._discover():    # none yet (built after the mount): ask later
                        self._retry_at = time.monotonic() + RETRY
                        return None
                w = self._open()
                if w is None:
                    self._off = True
                    return None
            st = _slot_state(w, h)
            if st is not None:
                return st
            self._close_map()           # replaced (grown) while we looked: map the new one
        return None

    def reset(self) -> None:
        """Forget the table (the mount may have changed): the next call discovers it again."""
        self._close_map()
        self._inos.clear()
        self.path, self._off, self._retry_at = None, False, 0.0

    close = reset
