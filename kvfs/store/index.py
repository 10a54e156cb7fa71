"""The LMDB index: namespace tree, attributes, object placement, access statistics.

One environment per process. Records are typed CBOR maps (kvfs.store.records), never pickle,
decoded here into ``InodeRecord``/``ObjectRecord`` and encoded back here; the key layout
below is this module's own (callers ask by id and name, they build no keys).
Group commits: a namespace operation is one ``Txn`` that never spans an await. It
buffers its changes and, when it ends cleanly, applies them to an in-memory table of
pending changes that every read consults first (with a cache of decoded inode
records), so lookups, attributes and directory entries are served from memory. The
pending table is written to LMDB in ONE write transaction (``commit``) by the
daemon's committer task a few milliseconds after the first change, inline once
``GROUP_OPS`` operations are pending, before any range read (readdir, counts, the
iterators), at fsync, at ``.kvfs/stats`` and at close. Each commit holds every
operation ended before it, so after kill -9 the index is the state after some prefix
of the operations: each file is one of its sealed versions or absent. The store
frees a durable copy's bytes only after the commit that dropped its record
(``ObjectStore.release_space``), and records only point at bytes already written.

Databases:
  meta     name -> value (format header, instance id, id counters, kvfs.store.marker)
  inodes   ino(u64) -> inode record
  dirents  parent(u64) + name -> child(u64) + eid(u64)
  dirorder parent(u64) + eid(u64) -> name       (stable readdir offsets)
  objects  oid(u64) -> object record
  recover  what a start after kill -9 reads instead of every record (kvfs.store.tally)

Damage is refused at open, never served: the state directory holds a header file
(``index.hdr``: format version, instance id, checksum) written when the index is
created; an index that is missing or empty while the header exists, whose LMDB
meta pages point past the end of ``data.mdb`` (a truncated file would SIGBUS on
first touch), whose format is unknown or whose header disagrees is refused with one
line naming ``kvfs fsck --repair``, which rebuilds it from the tiers.
"""
from __future__ import annotations

import logging
import itertools
import os
import struct
import time
import uuid
from pathlib import Path
from typing import Iterator

import lmdb

from kvfs.errors import IndexDamaged
from kvfs.protocol import ROOT_INO
from kvfs.store import marker, records
from kvfs.store.lmdbfile import HEADER_NAME, check_header, check_lmdb_file, make_header, open_env, read_header  # noqa: F401
from kvfs.store.records import FORMAT_VERSION, FSCK_HINT, InodeRecord, ObjectRecord
from kvfs.store.safedir import DirLock, holder_text, open_private_dir, write_file_atomic

log = logging.getLogger(__name__)

META, INODES, DIRENTS, DIRORDER, OBJECTS, RECOVER = range(6)    # database numbers in pending keys
VALID = marker.VALID        # in ``recover``: its running totals are valid (kvfs.store.tally)
GROUP_OPS = 1024            # operations pending before a commit runs inline
GROUP_DELAY = 0.02          # seconds the committer waits after the first pending change
ICACHE_MAX = 1 << 16        # decoded inode records kept (the rest decode from LMDB on use)
DCACHE_MAX = 1 << 16        # directory entries kept for lookups (the rest are read from LMDB)
_DEL = object()             # a pending deletion
_MISS = object()
_U64 = struct.Struct(">Q")
_U64x2 = struct.Struct(">QQ")
_ID_BATCH = 1024
ENV_NAME = "index.lmdb"
k64 = _U64.pack             # an id as an 8-byte key (big endian: keys sort by id)
_dumps = records.encode
_load_inode = records.decode_inode
_load_object = records.decode_object


def _trim(cache: dict, limit: int) -> None:
    """Over ``limit`` entries: the oldest go, down to half of it."""
    if len(cache) > limit:
        for k in list(itertools.islice(cache, len(cache) - limit // 2)):
            del cache[k]


class Index:
    """Typed access to the LMDB environment in ``state_dir``.

    ``holder`` names the lock's owner for the error a second daemon gets. ``instance``
    creates a missing index with that instance id (fsck's rebuild); otherwise a missing
    index is created only when the state directory never held one (no header file).
    """

    def __init__(self, state_dir: Path, *, map_size: int = 1 << 40, lock: bool = True,
                 holder: str | None = None, instance: str | None = None):
        self.state_dir = Path(state_dir)
        self.dir_fd = open_private_dir(self.state_dir, "state directory")
        self._lock: DirLock | None = None
        self.env = None
        try:
            if lock:
                self._lock = DirLock(self.dir_fd, self.state_dir, "state directory",
                                     holder or holder_text(None))
            self._open(map_size, instance)
        except BaseException:
            self._release()
            raise

    def _open(self, map_size: int, instance: str | None) -> None:
        header = read_header(self.dir_fd, self.state_dir)
        env_dir = self.state_dir / ENV_NAME
        data = env_dir / "data.mdb"
        exists = data.exists() and data.stat().st_size > 0
        if header is not None and not exists and instance is None:
            raise IndexDamaged(f"the index in {self.state_dir} is missing or empty but its header "
                               f"says it existed; {FSCK_HINT}")
        if exists:
            check_lmdb_file(data)
        if header is not None:
            check_header(header, f"{self.state_dir}/{HEADER_NAME}")
        self.env = open_env(env_dir, map_size, self.state_dir)
        self.meta = self.env.open_db(b"meta")
        self.inodes = self.env.open_db(b"inodes")
        self.dirents = self.env.open_db(b"dirents")
        self.dirorder = self.env.open_db(b"dirorder")
        self.objects = self.env.open_db(b"objects")
        self.recover = self.env.open_db(b"recover")
        self.tally = None           # kvfs.store.tally.Tally: running totals (the object store's)
        self._next: dict[bytes, list[int]] = {}
        self._dbs = (self.meta, self.inodes, self.dirents, self.dirorder, self.objects, self.recover)
        # (database, key) -> value (an InodeRecord/ObjectRecord for inodes and objects, else bytes) or _DEL
        self._pending: dict[tuple[int, bytes], object] = {}
        # pending keys LMDB does not hold (a name made in this group): a deletion in the same
        # group drops them from the group instead of deleting in LMDB (a temp name renamed away)
        self._fresh: set[tuple[int, bytes]] = set()
        self._ops = 0               # operations in _pending
        self._icache: dict[int, InodeRecord] = {}
        # dirent key -> inode read from LMDB (a known name's LOOKUP needs no read transaction);
        # every change of an entry passes through _apply, which drops its key
        self._dcache: dict[bytes, int] = {}
        self._wake = None           # the committer's trio.Event while it runs
        self.names = None           # kvfs.store.names.NameTable: sees every change of names
        self.commits = 0            # LMDB write transactions of group commits
        self.committed_ops = 0      # operations they held
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"format", db=self.meta)
            if raw is None:
                if txn.get(b"instance", db=self.meta) is not None or txn.stat(self.inodes)["entries"]:
                    raise IndexDamaged(f"the index in {self.state_dir} has no format header (an index "
                                       f"written before format {FORMAT_VERSION}?); {FSCK_HINT}")
                inst = instance or (header and header.get("instance")) or uuid.uuid4().hex
                if header is not None and header.get("instance") != inst:
                    raise IndexDamaged(f"{self.state_dir}: header instance differs; {FSCK_HINT}")
                txn.put(b"format", _dumps(make_header(inst)), db=self.meta)
                txn.put(b"instance", inst.encode(), db=self.meta)
                now = time.time_ns()
                root = InodeRecord(mode=0o40755, uid=os.getuid(), gid=os.getgid(), size=0, nlink=1, subdirs=0,
                                   atime=now, mtime=now, ctime=now, parent=ROOT_INO, name=b"", xattrs={})
                txn.put(k64(ROOT_INO), _dumps(root), db=self.inodes)
                txn.put(b"next_ino", k64(ROOT_INO + 1), db=self.meta)
            else:
                inner = check_header(records.decode_meta(raw), f"the index in {self.state_dir}")
                raw_inst = txn.get(b"instance", db=self.meta)
                if raw_inst is None or raw_inst.decode("ascii", "replace") != inner:
                    raise IndexDamaged(f"the index in {self.state_dir} disagrees with itself "
                                       f"(instance); {FSCK_HINT}")
                if header is not None and header.get("instance") != inner:
                    raise IndexDamaged(f"the index in {self.state_dir} belongs to instance {inner}, "
                                       f"its header to {header.get('instance')}; {FSCK_HINT}")
                if txn.get(k64(ROOT_INO), db=self.inodes) is None:
                    raise IndexDamaged(f"the index in {self.state_dir} has no root directory; {FSCK_HINT}")
            self.instance_id = txn.get(b"instance", db=self.meta).decode()
            self.clean = marker.take(txn, self.meta, self.state_dir)    # consumed by any opener
            self.untouched = marker.untouched(txn, self.meta, self.recover)
        if header is None:
            self.env.sync(True)
            write_file_atomic(self.dir_fd, HEADER_NAME, records.encode(make_header(self.instance_id)))

    def verify_records(self) -> int:
        """Decode every inode and object record (IndexDamaged at the first that does not
        parse); returns how many there are."""
        return sum(1 for _ in self.iter_inodes()) + sum(1 for _ in self.iter_objects())

    def get_meta(self, name: bytes) -> bytes | None:
        with self.env.begin() as txn:
            raw = txn.get(name, db=self.meta)
        return bytes(raw) if raw is not None else None

    def put_meta(self, name: bytes, value: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(name, value, db=self.meta)
            marker.stamp(txn, self.meta)

    def _release(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def close(self) -> None:
        try:
            if self.env is not None:
                self.commit()
                self.env.sync(True)
        finally:
            self._release()

    def sync(self) -> None:
        """Flush committed pages to the disk (any thread; ``commit`` first, on the owner's)."""
        self.env.sync(True)

    # group commits -----------------------------------------------------------
    @property
    def pending(self) -> int:
        """Operations applied in memory and not yet in LMDB."""
        return self._ops

    def commit(self) -> None:
        """Write every pending change to LMDB in one write transaction."""
        if not self._pending:
            return
        pending, ops, fresh = self._pending, self._ops, self._fresh
        self._pending, self._ops, self._fresh = {}, 0, set()
        dbs, encode = self._dbs, records.encode
        try:
            with self.env.begin(write=True) as txn:
                put, delete = txn.put, txn.delete
                marker.stamp(txn, self.meta)
                for (db, key), v in pending.items():
                    if v is _DEL:
                        delete(key, db=dbs[db])
                    elif db == INODES or db == OBJECTS:
                        put(key, encode(v), db=dbs[db])
                    else:
                        put(key, v, db=dbs[db])
        except BaseException:
            pending.update(self._pending)       # kept for the next try; newer changes win
            fresh |= self._fresh
            self._pending, self._ops, self._fresh = pending, ops + self._ops, fresh
            raise
        self.commits += 1
        self.committed_ops += ops

    async def serve_commits(self, delay: float = GROUP_DELAY, task_status=None) -> None:
        """The committer: commit ``delay`` seconds after the first pending change."""
        import trio
        self._wake = trio.Event()
        if task_status is not None:
            task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                await trio.sleep(delay)
                try:
                    self.commit()
                except lmdb.Error as e:     # kept pending; the next change or reader retries
                    log.error("index commit of %d operations failed: %s", self._ops, e)
        finally:
            self._wake = None

    def _apply(self, changes: dict, dirs: bool = False) -> None:
        """A finished Txn's changes join the pending table; its new names join the name
        table before that and its removed names leave after (``dirs``: kvfs.store.names)."""
        names = self.names
        gone = None if names is None else names.enter(changes, DIRENTS, dirs)
        pending, fresh, icache = self._pending, self._fresh, self._icache
        pending.update(changes)
        dcache = self._dcache
        for k, v in changes.items():
            if k[0] == INODES:
                if v is _DEL:
                    icache.pop(_U64.unpack(k[1])[0], None)
                else:
                    icache[_U64.unpack(k[1])[0]] = v
                continue
            if k[0] == DIRENTS:
                dcache.pop(k[1], None)
            if v is _DEL and k in fresh:      # made and removed within this group
                del pending[k]
                fresh.discard(k)
        if gone:
            names.leave(gone)
        self._ops += 1
        if self._ops >= GROUP_OPS:
            self.commit()
        elif self._wake is not None and not self._wake.is_set():
            self._wake.set()
        _trim(icache, ICACHE_MAX)

    def _get(self, db: int, key: bytes):
        """The current value: pending change, else LMDB (decoded for inodes and objects)."""
        v = self._pending.get((db, key), _MISS)
        if v is not _MISS:
            return None if v is _DEL else v
        with self.env.begin() as txn:
            raw = txn.get(key, db=self._dbs[db])
        if raw is None:
            return None
        if db == OBJECTS:
            return _load_object(raw)
        return bytes(raw)

    # id allocation: batches are committed before use, so ids are never reused
    def new_id(self, kind: bytes, txn=None) -> int:
        """A fresh id of ``kind`` (ino, oid, eid). A batch is reserved in its own LMDB
        transaction, committed at once (never with the pending changes)."""
        pool = self._next.get(kind)
        if not pool or pool[0] >= pool[1]:
            with self.env.begin(write=True) as t:
                raw = t.get(b"next_" + kind, db=self.meta)
                start = _U64.unpack(raw)[0] if raw else 1
                t.put(b"next_" + kind, k64(start + _ID_BATCH), db=self.meta)
                marker.stamp(t, self.meta)
            pool = self._next[kind] = [start, start + _ID_BATCH]
        n = pool[0]
        pool[0] += 1
        return n

    # reads -------------------------------------------------------------------
    def get_inode(self, ino: int) -> InodeRecord | None:
        """The inode's record, shared: callers must not change it (a Txn gives copies)."""
        rec = self._icache.get(ino)
        if rec is not None:
            return rec
        key = k64(ino)
        v = self._pending.get((INODES, key), _MISS)
        if v is not _MISS:
            return None if v is _DEL else v
        with self.env.begin() as txn:
            raw = txn.get(key, db=self.inodes)
        if raw is None:
            return None
        rec = self._icache[ino] = _load_inode(raw)
        _trim(self._icache, ICACHE_MAX)
        return rec

    def lookup(self, parent: int, name: bytes) -> int | None:
        names = self.names
        if names is not None and names.absent(parent, name):    # no LMDB read for a miss
            return None
        key = k64(parent) + name
        ino = self._dcache.get(key)
        if ino is None:
            raw = self._get(DIRENTS, key)
            if raw is None:
                return None
            ino = self._dcache[key] = _U64x2.unpack(raw)[0]
            _trim(self._dcache, DCACHE_MAX)
        return ino

    def readdir(self, parent: int, after_eid: int) -> Iterator[tuple[int, bytes, int]]:
        """Yield (eid, name, child ino) in eid order, starting after ``after_eid``."""
        self.commit()
        prefix = k64(parent)
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.dirorder)
            if not cur.set_range(prefix + k64(after_eid + 1)):
                return
            rows = []
            for key, name in cur:
                if key[:8] != prefix:
                    break
                rows.append((_U64.unpack(key[8:])[0], bytes(name)))
            for eid, name in rows:
                raw = txn.get(prefix + name, db=self.dirents)
                if raw is not None:
                    yield eid, name, _U64x2.unpack(raw)[0]

    def resolve(self, base: list[bytes], paths: list[bytes]) -> Iterator[int]:
        """The inode of each of ``paths`` (``/``-separated, relative to the directory ``base``,
        its components from the root), in order, in one read transaction, until the first
        missing one. Directories met on the way are resolved once per call (chains of KV
        blocks share a namespace directory and its shard directories)."""
        self.commit()
        with self.env.begin() as txn:
            get, dirents, unpack = txn.get, self.dirents, _U64.unpack_from
            top = k64(ROOT_INO)
            for c in base:
                raw = get(top + c, None, dirents)
                if raw is None:
                    return
                top = raw[:8]
            dirs: dict[bytes, bytes | None] = {}
            for p in paths:
                cut = p.rfind(b"/")
                parent = top
                if cut >= 0:
                    d = p[:cut]
                    parent = dirs.get(d, b"")
                    if parent == b"":
                        parent = top
                        for c in d.split(b"/"):
                            if c and c != b"." and parent is not None:
                                raw = get(parent + c, None, dirents)
                                parent = None if raw is None else raw[:8]
                        dirs[d] = parent
                    if parent is None:
                        return
                raw = get(parent + p[cut + 1:], None, dirents)
                if raw is None:
                    return
                yield unpack(raw)[0]

    def has_children(self, parent: int) -> bool:
        self.commit()
        prefix = k64(parent)
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.dirents)
            return cur.set_range(prefix) and cur.key()[:8] == prefix

    def get_object(self, oid: int) -> ObjectRecord | None:
        return self._get(OBJECTS, k64(oid))

    def iter_objects(self) -> Iterator[tuple[int, ObjectRecord]]:
        self.commit()
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.objects):
                yield _U64.unpack(k)[0], _load_object(v)

    def iter_inodes(self) -> Iterator[tuple[int, InodeRecord]]:
        self.commit()
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.inodes):
                yield _U64.unpack(k)[0], _load_inode(v)

    def iter_dirents(self) -> Iterator[tuple[int, bytes, int]]:
        self.commit()
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.dirents):
                yield _U64.unpack(k[:8])[0], bytes(k[8:]), _U64x2.unpack(v)[0]

    def counts(self) -> dict[str, int]:
        self.commit()
        with self.env.begin() as txn:
            return {"inodes": txn.stat(self.inodes)["entries"], "objects": txn.stat(self.objects)["entries"]}

    # writes ------------------------------------------------------------------
    def write(self) -> "Txn":
        """A write transaction with typed helpers; use as a context manager."""
        return Txn(self)


class Txn:
    """One namespace operation: reads see the pending table and this operation's own
    changes; the changes join the pending table on clean exit and are dropped on an
    exception. Records it returns are copies the caller may change and put back."""

    __slots__ = ("ix", "w", "d", "dirs")

    def __init__(self, index: Index):
        self.ix = index
        self.w: dict[tuple[int, bytes], object] = {}
        self.d = None               # differences of the running totals (kvfs.store.tally)
        self.dirs = False           # an entry that was not a regular file goes (kvfs.store.names)

    def __enter__(self) -> "Txn":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.w:
            if self.d:
                self.ix.tally.apply(self.d, self)
            self.ix._apply(self.w, self.dirs)   # new names enter the name table before they are visible

    def _get(self, db: int, key: bytes):
        v = self.w.get((db, key), _MISS)
        if v is _MISS:
            return self.ix._get(db, key)
        return None if v is _DEL else v

    def new_id(self, kind: bytes) -> int:
        return self.ix.new_id(kind)

    def recover_set(self, key: bytes, value: bytes | None) -> None:
        """Set ``key`` of the ``recover`` database (kvfs.store.tally's) to ``value`` (None: delete)."""
        self.w[(RECOVER, key)] = _DEL if value is None else value

    def get_inode(self, ino: int) -> InodeRecord | None:
        v = self.w.get((INODES, k64(ino)), _MISS)
        rec = self.ix.get_inode(ino) if v is _MISS else (None if v is _DEL else v)
        return None if rec is None else rec.copy()

    def put_inode(self, ino: int, rec: InodeRecord, new: bool = False) -> None:
        """``new``: ``ino`` was just allocated (no key of it is in LMDB yet)."""
        key = k64(ino)
        if rec.kv is not None:          # an inode with a KV record: not "none has one" (tally.py)
            self.w[(RECOVER, b"k")] = _DEL
        if rec.mode & 0o170000 == 0o100000:         # keep the set of unsealed files (tally.py)
            if rec.oid is None:
                uk = (RECOVER, b"u" + key)
                self.w[uk] = b""
                if new:                 # sealed within this group: no LMDB put, no delete
                    self.ix._fresh.add(uk)
            elif not new:               # a new inode was never unsealed
                self._sealed(ino, key)
        self.w[(INODES, key)] = rec

    def del_inode(self, ino: int) -> None:
        key = k64(ino)
        self._sealed(ino, key)
        self.w[(INODES, key)] = _DEL

    def _sealed(self, ino: int, key: bytes) -> None:
        """Inode ``ino`` leaves the set of unsealed files if it was in it."""
        old = self._rec(ino, key)
        if old is not None and old.mode & 0o170000 == 0o100000 and old.oid is None:
            self.w[(RECOVER, b"u" + key)] = _DEL

    def _rec(self, ino: int, key: bytes) -> InodeRecord | None:
        v = self.w.get((INODES, key), _MISS)    # as this operation sees it (not a copy: read only)
        return self.ix.get_inode(ino) if v is _MISS else (None if v is _DEL else v)

    def _gone(self, ino: int) -> None:
        """An entry of ``ino`` goes: not a regular file (or unknown)? ``dirs`` (kvfs.store.names)."""
        if not self.dirs and self.ix.names is not None:
            self.dirs = (rec := self._rec(ino, k64(ino))) is None or rec.mode & 0o170000 != 0o100000

    def _dirent(self, parent: int, name: bytes) -> bytes | None:
        """The entry as this operation sees it; the name table answers a name absent from it
        and from this operation's own changes (those join the table when the operation ends)."""
        key = k64(parent) + name
        v = self.w.get((DIRENTS, key), _MISS)
        if v is not _MISS:
            return None if v is _DEL else v
        names = self.ix.names
        if names is not None and names.absent(parent, name):
            return None
        return self.ix._get(DIRENTS, key)

    def lookup(self, parent: int, name: bytes) -> int | None:
        raw = self._dirent(parent, name)
        return _U64x2.unpack(raw)[0] if raw is not None else None

    def link(self, parent: int, name: bytes, child: int, new: bool = False) -> None:
        p = k64(parent)
        old = None if new else self._dirent(parent, name)    # new: the caller knows it is free
        if old is not None:
            was, oeid = _U64x2.unpack(old)
            if was != child:
                self._gone(was)
            self.w[(DIRORDER, p + k64(oeid))] = _DEL
        eid = self.ix.new_id(b"eid")
        dk, ok = (DIRENTS, p + name), (DIRORDER, p + k64(eid))
        if new and dk not in self.ix._pending and dk not in self.w:
            self.fresh(dk)                      # free and not pending: LMDB has no such key
        self.fresh(ok)                          # a new entry id is in no key yet
        self.w[dk] = _U64x2.pack(child, eid)
        self.w[ok] = name

    def fresh(self, key: tuple[int, bytes]) -> None:
        """``key`` is not in LMDB (noted when this operation joins the pending table)."""
        self.ix._fresh.add(key)

    def unlink(self, parent: int, name: bytes) -> None:
        p = k64(parent)
        raw = self._get(DIRENTS, p + name)
        if raw is None:
            return
        child, eid = _U64x2.unpack(raw)
        self._gone(child)
        self.w[(DIRENTS, p + name)] = _DEL
        self.w[(DIRORDER, p + k64(eid))] = _DEL

    def has_children(self, parent: int) -> bool:
        prefix = k64(parent)
        for (db, key), v in self.w.items():
            if db == DIRENTS and key[:8] == prefix and v is not _DEL:
                return True
        self.ix.commit()            # earlier operations only: this one's changes stay here
        with self.ix.env.begin() as t:
            cur = t.cursor(db=self.ix.dirents)
            if not cur.set_range(prefix):
                return False
            for key in cur.iternext(values=False):
                if key[:8] != prefix:
                    return False
                if self.w.get((DIRENTS, bytes(key))) is not _DEL:
                    return True
        return False

    def put_object(self, oid: int, rec: ObjectRecord | None, old=_MISS) -> None:
        """``rec`` None: delete; ``old``: the record it replaces, if the caller knows it (None:
        a new object). The running totals follow (or, without a tally, go invalid)."""
        if self.ix.tally is not None:
            self.ix.tally.object(self, oid, self.get_object(oid) if old is _MISS else old, rec)
        else:
            self.w[(RECOVER, VALID)] = _DEL
        self.w[(OBJECTS, k64(oid))] = _DEL if rec is None else rec

    def get_object(self, oid: int) -> ObjectRecord | None:
        return self._get(OBJECTS, k64(oid))

    def del_object(self, oid: int) -> None:
        self.put_object(oid, None)
