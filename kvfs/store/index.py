"""The LMDB index: namespace tree, attributes, object placement, access statistics.

One environment per process. Every public mutator is one write transaction that
never spans an await, so each namespace operation is atomic on disk. Records are
pickled dicts of plain types (int, str, bytes, dict, tuple).

Databases:
  meta     name -> value (instance id, id counters)
  inodes   ino(u64) -> inode record
  dirents  parent(u64) + name -> child(u64) + eid(u64)
  dirorder parent(u64) + eid(u64) -> name       (stable readdir offsets)
  objects  oid(u64) -> object record
"""
from __future__ import annotations

import fcntl
import logging
import os
import pickle
import struct
import uuid
from pathlib import Path
from typing import Iterator

import lmdb

from kvfs.errors import ConfigError

log = logging.getLogger(__name__)

ROOT_INO = 1
_U64 = struct.Struct(">Q")
_U64x2 = struct.Struct(">QQ")
_ID_BATCH = 1024


def k64(n: int) -> bytes:
    return _U64.pack(n)


def _dumps(rec: dict) -> bytes:
    return pickle.dumps(rec, protocol=5)


_loads = pickle.loads


class Index:
    """Typed access to the LMDB environment in ``state_dir``."""

    def __init__(self, state_dir: Path, *, map_size: int = 1 << 40, lock: bool = True):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lockf = None
        if lock:
            self._lockf = open(self.state_dir / "lock", "a+")
            try:
                fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lockf.close()
                raise ConfigError(f"state directory {self.state_dir} is in use by another kvfs mount") from None
        # sync=False: commits survive kill -9 (the page cache keeps them); sync()
        # is called periodically and at unmount for power-loss durability.
        self.env = lmdb.open(str(self.state_dir / "index.lmdb"), map_size=map_size, max_dbs=8,
                             subdir=True, sync=False, metasync=False, readahead=False, lock=True)
        self.meta = self.env.open_db(b"meta")
        self.inodes = self.env.open_db(b"inodes")
        self.dirents = self.env.open_db(b"dirents")
        self.dirorder = self.env.open_db(b"dirorder")
        self.objects = self.env.open_db(b"objects")
        self._next: dict[bytes, list[int]] = {}
        with self.env.begin(write=True) as txn:
            if txn.get(b"instance", db=self.meta) is None:
                txn.put(b"instance", uuid.uuid4().hex.encode(), db=self.meta)
                now = _now_ns()
                root = dict(mode=0o40755, uid=os.getuid(), gid=os.getgid(), size=0, nlink=1,
                            atime=now, mtime=now, ctime=now, parent=ROOT_INO, name=b"", xattrs={})
                txn.put(k64(ROOT_INO), _dumps(root), db=self.inodes)
                txn.put(b"next_ino", k64(ROOT_INO + 1), db=self.meta)
            self.instance_id = txn.get(b"instance", db=self.meta).decode()

    def close(self) -> None:
        try:
            self.env.sync(True)
        finally:
            self.env.close()
            if self._lockf:
                self._lockf.close()

    def sync(self) -> None:
        self.env.sync(True)

    # id allocation: batches are committed before use, so ids are never reused
    def new_id(self, kind: bytes, txn: lmdb.Transaction | None = None) -> int:
        """A fresh id of ``kind`` (ino, oid, eid). Pass the open write txn if any."""
        pool = self._next.get(kind)
        if not pool or pool[0] >= pool[1]:
            def reserve(t):
                raw = t.get(b"next_" + kind, db=self.meta)
                start = _U64.unpack(raw)[0] if raw else 1
                t.put(b"next_" + kind, k64(start + _ID_BATCH), db=self.meta)
                return start
            if txn is not None:
                start = reserve(txn)
            else:
                with self.env.begin(write=True) as t:
                    start = reserve(t)
            pool = self._next[kind] = [start, start + _ID_BATCH]
        n = pool[0]
        pool[0] += 1
        return n

    # reads -------------------------------------------------------------------
    def get_inode(self, ino: int) -> dict | None:
        with self.env.begin() as txn:
            raw = txn.get(k64(ino), db=self.inodes)
        return _loads(raw) if raw is not None else None

    def lookup(self, parent: int, name: bytes) -> int | None:
        with self.env.begin() as txn:
            raw = txn.get(k64(parent) + name, db=self.dirents)
        return _U64x2.unpack(raw)[0] if raw is not None else None

    def resolve_prefix(self, base: list[bytes], paths: list[bytes], sealed: dict) -> list:
        """Resolve ``paths`` (``/``-separated, relative to the directory ``base``, a list of
        components from the root) in order, in one read txn, and map each inode through
        ``sealed`` (ino -> object) until the first that is missing, not in ``sealed``, or
        whose object is ``dead``. Returns the objects of the leading paths.

        Directories met on the way are resolved once per call (chains of KV blocks share a
        namespace directory and 256 shard directories).
        """
        out: list = []
        dirs: dict[bytes, int | None] = {}
        with self.env.begin() as txn:
            get = txn.get
            ino: int | None = ROOT_INO
            for c in base:
                raw = get(k64(ino) + c, db=self.dirents)
                if raw is None:
                    return out
                ino = _U64x2.unpack(raw)[0]
            base_key = k64(ino)
            dirents = self.dirents
            unpack = _U64.unpack_from
            for p in paths:
                cut = p.rfind(b"/")
                if cut < 0:
                    parent_key, name = base_key, p
                else:
                    d = p[:cut]
                    parent_key = dirs.get(d, b"")
                    if parent_key == b"":
                        parent_key = base_key
                        for c in d.split(b"/"):
                            if not c or c == b".":
                                continue
                            raw = get(parent_key + c, None, dirents)
                            if raw is None:
                                parent_key = None
                                break
                            parent_key = raw[:8]
                        dirs[d] = parent_key
                    if parent_key is None:
                        break
                    name = p[cut + 1:]
                raw = get(parent_key + name, None, dirents)
                if raw is None:
                    break
                v = sealed.get(unpack(raw)[0])
                if v is None or v.dead:
                    break
                out.append(v)
        return out

    def readdir(self, parent: int, after_eid: int) -> Iterator[tuple[int, bytes, int]]:
        """Yield (eid, name, child ino) in eid order, starting after ``after_eid``."""
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

    def has_children(self, parent: int) -> bool:
        prefix = k64(parent)
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.dirents)
            return cur.set_range(prefix) and cur.key()[:8] == prefix

    def get_object(self, oid: int) -> dict | None:
        with self.env.begin() as txn:
            raw = txn.get(k64(oid), db=self.objects)
        return _loads(raw) if raw is not None else None

    def iter_objects(self) -> Iterator[tuple[int, dict]]:
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.objects):
                yield _U64.unpack(k)[0], _loads(v)

    def iter_inodes(self) -> Iterator[tuple[int, dict]]:
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.inodes):
                yield _U64.unpack(k)[0], _loads(v)

    def iter_dirents(self) -> Iterator[tuple[int, bytes, int]]:
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.dirents):
                yield _U64.unpack(k[:8])[0], bytes(k[8:]), _U64x2.unpack(v)[0]

    def counts(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {"inodes": txn.stat(self.inodes)["entries"], "objects": txn.stat(self.objects)["entries"]}

    # writes ------------------------------------------------------------------
    def write(self) -> "Txn":
        """A write transaction with typed helpers; use as a context manager."""
        return Txn(self)


class Txn:
    """One LMDB write transaction. Commits on clean exit, aborts on exception."""

    def __init__(self, index: Index):
        self.ix = index
        self.txn = index.env.begin(write=True)

    def __enter__(self) -> "Txn":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.txn.commit()
        else:
            self.txn.abort()
            self.ix._next.clear()   # an id batch reserved in this txn was not committed

    def new_id(self, kind: bytes) -> int:
        return self.ix.new_id(kind, self.txn)

    def get_inode(self, ino: int) -> dict | None:
        raw = self.txn.get(k64(ino), db=self.ix.inodes)
        return _loads(raw) if raw is not None else None

    def put_inode(self, ino: int, rec: dict) -> None:
        self.txn.put(k64(ino), _dumps(rec), db=self.ix.inodes)

    def del_inode(self, ino: int) -> None:
        self.txn.delete(k64(ino), db=self.ix.inodes)

    def lookup(self, parent: int, name: bytes) -> int | None:
        raw = self.txn.get(k64(parent) + name, db=self.ix.dirents)
        return _U64x2.unpack(raw)[0] if raw is not None else None

    def link(self, parent: int, name: bytes, child: int) -> None:
        old = self.txn.get(k64(parent) + name, db=self.ix.dirents)
        if old is not None:
            self.txn.delete(k64(parent) + k64(_U64x2.unpack(old)[1]), db=self.ix.dirorder)
        eid = self.ix.new_id(b"eid", self.txn)
        self.txn.put(k64(parent) + name, _U64x2.pack(child, eid), db=self.ix.dirents)
        self.txn.put(k64(parent) + k64(eid), name, db=self.ix.dirorder)

    def unlink(self, parent: int, name: bytes) -> None:
        raw = self.txn.get(k64(parent) + name, db=self.ix.dirents)
        if raw is None:
            return
        self.txn.delete(k64(parent) + name, db=self.ix.dirents)
        self.txn.delete(k64(parent) + k64(_U64x2.unpack(raw)[1]), db=self.ix.dirorder)

    def has_children(self, parent: int) -> bool:
        prefix = k64(parent)
        cur = self.txn.cursor(db=self.ix.dirents)
        return cur.set_range(prefix) and cur.key()[:8] == prefix

    def put_object(self, oid: int, rec: dict) -> None:
        self.txn.put(k64(oid), _dumps(rec), db=self.ix.objects)

    def get_object(self, oid: int) -> dict | None:
        raw = self.txn.get(k64(oid), db=self.ix.objects)
        return _loads(raw) if raw is not None else None

    def del_object(self, oid: int) -> None:
        self.txn.delete(k64(oid), db=self.ix.objects)


def _now_ns() -> int:
    import time
    return time.time_ns()
