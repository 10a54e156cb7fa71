"""The name table: which directory entries exist, in shared memory, for clients to answer
"absent" without a round trip through FUSE (kvfs.kv.names reads it).

One file (layout in kvfs.protocol) in the RAM tier's directory: a header (magic, version,
capacity, generation, the run id ``.kvfs/stats`` publishes, live count) and a power-of-two
array of uint64 slots holding ``names_hash(parent inode, name)`` of every directory entry,
with linear probing and tombstones. The daemon's trio thread is the only writer; readers do
aligned 8-byte loads (single loads on x86-64 and arm64).

Ordering is what makes "absent" safe: every index transaction's changes pass through
:meth:`NameTable.apply`, which adds the entries a transaction creates *before* its changes
become visible to lookups and removes the entries it deletes *after*. A name absent from the
table is therefore absent from the namespace at that instant. "Present" may be stale (a
removal not yet applied, a hash collision, a transaction that failed after the add): the
client confirms it by the ordinary lookup, or reads the entry by name afterwards and takes
one that is not there as a miss (kvfs.integrations.pages): never a wrong answer. Two distinct live entries with one 64-bit hash (chance ~n²/2^65) would let the
removal of one hide the other: a false miss (the runtime recomputes), not a wrong read.

Growing (or clearing tombstones) writes a new file, renames it over the old name, and only
then marks the old one stale (generation NAMES_STALE): a reader that sees the same live
generation before and after its probe got an answer that held at that instant; otherwise it
remaps. A crashed daemon's file goes with its RAM-tier directory; a new daemon has a new run id
and marks the crashed one's table stale before removing it (:func:`retire`).

Cached directory inodes (version 2): a reader keeps ``path -> inode`` of the directories it
asks about without a ``stat`` per call while the header word ``H_DIRS`` has not moved. It
counts removed entries that were not regular files (:meth:`NameTable.apply` with ``dirs``:
bumped *before* the transaction is visible, so a reader that reads the same count before its
``stat`` and after its probe saw the path lead to that inode throughout). What the table cannot
see (the mount itself going: killed, lazily unmounted, another mount at the path) the reader
catches by a ``stat`` of each cached directory at most a second old (kvfs.kv.names).

Who may read it: the file lives in the RAM tier's directory (mode 0700, the daemon's user).
A table of hashes is an existence oracle for guessed names -- it would let a user who cannot
search a tenant's directory test whether a block is cached there -- so it is not readable by
other users; their clients fall back to the ordinary lookup.
"""
from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import secrets
import time

import trio

from kvfs.protocol import (H_CAPACITY, H_DIRS, H_GENERATION, H_LIVE, H_MAGIC, H_RUN, H_VERSION, NAMES_EMPTY,
                           NAMES_HEADER, NAMES_MAGIC, NAMES_STALE, NAMES_TOMB, NAMES_VERSION, names_hash,
                           names_hash_key)

log = logging.getLogger(__name__)

FILE_NAME = "names.table"
MIN_CAPACITY = 1 << 10         # 8 KiB; doubles as names come
MAX_LOAD = 0.6              # (live + tombstones) / capacity that triggers a rebuild


def _capacity_for(live: int) -> int:
    cap = MIN_CAPACITY
    while cap * MAX_LOAD < 2 * live + 1:
        cap <<= 1
    return cap


class _Mapped:
    """One table file, mapped read-write."""

    def __init__(self, path: str, capacity: int, generation: int, run: int, dirs: int = 0):
        size = 8 * (NAMES_HEADER + capacity)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            # every page now: a full tmpfs answers ENOSPC here (the table is disabled), where a
            # sparse file would SIGBUS the daemon at a write into the mapping
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.words = memoryview(self.map).cast("Q")
        self.capacity, self.mask = capacity, capacity - 1
        self.used = 0               # live + tombstones
        self.live = 0
        w = self.words
        w[H_VERSION], w[H_CAPACITY], w[H_RUN], w[H_GENERATION] = NAMES_VERSION, capacity, run, generation
        w[H_DIRS] = dirs
        w[H_MAGIC] = NAMES_MAGIC    # last: a reader never sees a half-made header as valid

    def add(self, h: int) -> None:
        w, mask, tomb = self.words, self.mask, -1
        i = h & mask
        while True:
            v = w[NAMES_HEADER + i]
            if v == h:
                return
            if v == NAMES_EMPTY:
                break
            if v == NAMES_TOMB and tomb < 0:
                tomb = i
            i = (i + 1) & mask
        if tomb >= 0:
            i = tomb
        else:
            self.used += 1
        w[NAMES_HEADER + i] = h
        self.live += 1
        w[H_LIVE] = self.live

    def _find(self, h: int) -> int:
        """The slot holding ``h``, or -1."""
        w, mask = self.words, self.mask
        i = h & mask
        while True:
            v = w[NAMES_HEADER + i]
            if v == h:
                return i
            if v == NAMES_EMPTY:
                return -1
            i = (i + 1) & mask

    def has(self, h: int) -> bool:
        return self._find(h) >= 0

    def remove(self, h: int) -> None:
        i = self._find(h)
        if i >= 0:
            w = self.words
            w[NAMES_HEADER + i] = NAMES_TOMB
            self.live -= 1
            w[H_LIVE] = self.live

    def values(self):
        w = self.words
        for i in range(NAMES_HEADER, NAMES_HEADER + self.capacity):
            if w[i] > NAMES_TOMB:
                yield w[i]

    def close(self, stale: bool) -> None:
        if stale:
            self.words[H_GENERATION] = NAMES_STALE
        self.words.release()
        self.map.close()


class NameTable:
    """The daemon's writer of the name table in directory ``where``."""

    def __init__(self, where: str):
        self.dir = where
        self.path = os.path.join(where, FILE_NAME)
        self.run = secrets.randbits(63) | 1
        self.generation = 0
        self.rebuilds = 0
        self.dirs = 0               # H_DIRS: removals of entries that were not regular files
        self.t: _Mapped | None = None
        self._gone: set[int] | None = None     # while building: names removed since it began

    def open(self, entries) -> None:
        """Build the table from ``entries``: (parent inode, name) of every directory entry."""
        self.begin(0)
        self.add_existing(entries)
        self.finish()

    def begin(self, expected: int) -> None:
        """Start a table that is not advertised (``statistics()`` is None) until :meth:`finish`.
        From now on :meth:`apply` keeps it exact for every change; the entries that existed
        before come in chunks through :meth:`add_existing`, read at any time later: a name
        removed since is skipped (``_gone``), one added since is already in."""
        self._gone = set()
        self._replace(_capacity_for(expected), ())

    def add_existing(self, entries) -> int:
        """Add pre-existing directory entries ((parent inode, name) pairs) during a build."""
        gone, n = self._gone, 0
        if self.t is None or gone is None:
            return 0
        for p, name in entries:
            h = names_hash(p, name)
            if h not in gone:
                self._add(h)
                n += 1
        return n

    def finish(self) -> None:
        """The build is complete: advertise the table."""
        if self.t is not None and self._gone is not None:
            self._gone = None
            log.info("name table %s: %d names, %d slots", self.path, self.t.live, self.t.capacity)

    def absent(self, parent: int, name: bytes) -> bool:
        """True: directory ``parent`` has no entry ``name`` (exact, as for readers: an entry is
        added before it is visible); False: it may have one, or there is no complete table."""
        t = self.t
        return t is not None and self._gone is None and not t.has(names_hash(parent, name))

    @property
    def building(self) -> bool:
        return self._gone is not None

    def _replace(self, capacity: int, hashes) -> None:
        """A new file with ``hashes`` renamed over the table, then the old one marked stale."""
        self.generation += 1
        tmp = f"{self.path}.{self.generation}"
        new = _Mapped(tmp, capacity, self.generation + 1, self.run, self.dirs)   # generation 0: "stale"
        try:
            for h in hashes:
                new.add(h)
            os.rename(tmp, self.path)
        except BaseException:
            new.close(stale=True)
            os.unlink(tmp)
            raise
        old, self.t = self.t, new
        if old is not None:
            old.close(stale=True)

    def apply(self, changes: dict, commit, dirents_db: int, dirs: bool = False) -> None:
        """Run ``commit()`` (which makes a transaction's ``changes`` visible) between adding
        its new directory entries and removing its deleted ones. ``changes`` maps (db, key)
        to a value or a deletion marker; a DIRENTS key is the parent inode (8 bytes, big
        endian) and the name. ``dirs``: the transaction removes (or replaces) an entry that
        was not a regular file: readers' cached directory inodes stop counting first."""
        gone = self.enter(changes, dirents_db, dirs)
        commit()
        self.leave(gone)

    def enter(self, changes: dict, dirents_db: int, dirs: bool = False) -> list[int] | None:
        """The first half of :meth:`apply`, before the changes are visible: add the new
        entries (and count ``dirs``); returns what :meth:`leave` removes after."""
        if self.t is None:
            return None
        if dirs:
            self.dirs += 1
            self.t.words[H_DIRS] = self.dirs
        gone, building = [], self._gone
        try:
            for (db, key), v in changes.items():
                if db != dirents_db:
                    continue
                h = names_hash_key(key)
                if v.__class__ is bytes:
                    self._add(h)
                    if building is not None:
                        building.discard(h)
                else:
                    gone.append(h)
        except OSError as e:            # cannot grow (shared memory full): readers fall back
            log.error("name table %s cannot grow (%s): disabled, clients use lookups", self.path, e)
            self.close()
        return gone

    def leave(self, gone: list[int] | None) -> None:
        """The second half of :meth:`apply`, once the changes are visible: remove the
        deleted entries."""
        if gone and self.t is not None:
            remove = self.t.remove
            for h in gone:
                remove(h)
            if self._gone is not None:
                self._gone.update(gone)

    def _add(self, h: int) -> None:
        t = self.t
        if t.used + 1 > t.capacity * MAX_LOAD:
            self.rebuilds += 1
            self._replace(_capacity_for(t.live + 1), list(t.values()))
            t = self.t
        t.add(h)

    def statistics(self) -> dict | None:
        """What ``.kvfs/stats`` advertises as ``names``: None while there is none or it is being built."""
        if self.t is None or self._gone is not None:
            return None
        return {"path": self.path, "run": self.run, "names": self.t.live,
                "capacity": self.t.capacity, "rebuilds": self.rebuilds, "dirs_removed": self.dirs}

    def close(self) -> None:
        """Mark the table stale and remove it (at unmount, or when it cannot be kept)."""
        t, self.t, self._gone = self.t, None, None
        if t is None:
            return
        t.close(stale=True)
        try:
            os.unlink(self.path)
        except OSError as e:
            log.warning("could not remove the name table %s: %s", self.path, e)


def retire(dir_fd: int) -> bool:
    """Mark the table in the directory ``dir_fd`` (a dead daemon's RAM-tier directory, about to
    be removed) stale, so that the readers that still map it stop answering from it now rather
    than at their next check of the directory. True if there was one."""
    try:
        fd = os.open(FILE_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < 8 * NAMES_HEADER:
            return False
        # pread/pwrite, not a mapping: a dead daemon's file may have holes, and a fault on a
        # hole of a full tmpfs is a SIGBUS; readers that map it see the pwrite all the same
        if int.from_bytes(os.pread(fd, 8, 8 * H_MAGIC), "little") != NAMES_MAGIC:
            return False
        if os.pwrite(fd, NAMES_STALE.to_bytes(8, "little"), 8 * H_GENERATION) != 8:
            raise OSError(errno.ENOSPC, "short write of the name table's generation")
        log.info("marked a dead daemon's name table stale")
        return True
    except (OSError, ValueError) as e:
        log.warning("could not mark a dead daemon's name table stale: %s", e)
        return False
    finally:
        os.close(fd)


def dirent_count(index) -> int:
    with index.env.begin() as txn:
        return txn.stat(index.dirents)["entries"]


def dirent_keys_after(index, after: bytes, limit: int) -> list[bytes]:
    """Up to ``limit`` directory-entry keys (parent inode, name) after ``after`` in the index's
    LMDB (not its pending table: changes since the build began reach the table through apply)."""
    with index.env.begin() as txn:
        cur = txn.cursor(db=index.dirents)
        if not cur.set_range(after):
            return []
        keys = [bytes(k) for k in itertools.islice(cur.iternext(values=False), limit + 1)]
    return [k for k in keys if k != after][:limit]


async def build_in_background(index, table: NameTable, step: int = 8192) -> None:
    """Fill ``table`` (after :meth:`NameTable.begin`) with the index's directory entries, ``step``
    at a time on the trio thread (so it never races apply), then advertise it."""
    t0, after, n = time.monotonic(), b"", 0
    while table.building:
        keys = dirent_keys_after(index, after, step)
        if not keys:
            table.finish()
            break
        try:
            n += table.add_existing((int.from_bytes(k[:8], "big"), k[8:]) for k in keys)
        except OSError as e:            # cannot grow (shared memory full): readers keep using lookups
            log.error("name table %s cannot grow (%s): disabled, clients use lookups", table.path, e)
            table.close()
            return
        after = keys[-1]
        await trio.sleep(0)
    log.info("name table built in the background: %d existing names in %.2fs", n, time.monotonic() - t0)
