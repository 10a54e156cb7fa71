"""The namespace: directories, names, attributes and xattrs, over the LMDB index.

Each method is one index write transaction, so a crash leaves every operation
either done or not. Objects are dropped through the ObjectStore in the same
transaction that removes their last name; the caller frees their bytes after.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import time
from typing import Callable

from kvfs.errors import NamespaceError
from kvfs.protocol import CONTROL_NAME_B as CONTROL_NAME
from kvfs.store.index import ROOT_INO, Index, Txn
from kvfs.store.objects import Obj, ObjectStore
from kvfs.store.records import InodeRecord

log = logging.getLogger(__name__)

NAME_MAX = 255


def _err(code: int, msg: str = "") -> NamespaceError:
    return NamespaceError(code, msg or os.strerror(code))


def _count_subdir(rec: InodeRecord, delta: int) -> None:
    """Count a subdirectory in or out of a directory's record. Directories made before
    kvfs counted them (or rebuilt by fsck) have no count and report st_nlink 1 ("unknown",
    as find(1) reads it) for good."""
    if delta and rec.subdirs is not None:
        rec.subdirs = max(0, rec.subdirs + delta)


class SealedMap(dict):
    """inode -> its sealed object, for regular files that have one. After a clean mount
    it starts empty and ``get``/``[]`` fill it from the inode record and the object table
    (recovery after a crash fills it for every file)."""

    def __init__(self, ns: "Namespace"):
        super().__init__()
        self.ns = ns
        self.lazy = False

    def _fill(self, ino):
        if not self.lazy or ino is None:
            return None
        rec = self.ns.index.get_inode(ino)
        if rec is None or not stat.S_ISREG(rec.mode) or rec.oid is None:
            return None
        obj = self.ns.store.objs.get(rec.oid)
        if obj is not None:
            dict.__setitem__(self, ino, obj)
        return obj

    def get(self, ino, default=None):
        obj = dict.get(self, ino)
        if obj is None:
            obj = self._fill(ino)
        return default if obj is None else obj

    def __missing__(self, ino):
        obj = self._fill(ino)
        if obj is None:
            raise KeyError(ino)
        return obj


class Namespace:
    def __init__(self, index: Index, store: ObjectStore):
        self.index = index
        self.store = store
        # prefix-aware eviction: the store's prefix rule, counting each KV block's cached children
        self.prefix = store.policy.prefix
        # inode -> its sealed object, for regular files that have one: answers "is this name a
        # sealed file?" without reading and unpickling inode records (batched prefix lookups)
        self.sealed = SealedMap(self)
        self.orphans: dict[int, InodeRecord] = {}      # unlinked inodes still open
        # orphans whose name the daemon removed by itself (an eviction while a reader held an
        # older version): the kernel may still hold the name until its notification lands
        self.evicted: set[int] = set()
        self.renames = 0        # renames so far: a path taken before an await holds if unchanged
        self.dir_renames = 0    # renames of directories: what top_of remembers holds if unchanged
        self._tops: dict[int, tuple[int, str]] = {}
        self.is_open: Callable[[int], bool] = lambda ino: False     # set by the Store (FileHandles.is_open)
        # regular files made in this session and not sealed yet (dropped at a clean unmount,
        # as recovery would drop them: the next mount need not look for them)
        self.unsealed: set[int] = set()
        # kernel cache invalidation of names the store removed on its own (eviction, corruption)
        self.on_name_removed = lambda parent, name, ino: None
        store.on_lost = self._lost
        store.key_of = lambda obj: self.path_of(obj.ino)
        store.on_materialize = self._materialized

    def start_clean(self) -> None:
        """After a clean unmount: nothing to recover; sealed files and objects are looked
        up when used, KV child counts come from the store's background scan."""
        self.sealed.lazy = True

    def _materialized(self, obj: Obj) -> None:
        rec = self.index.get_inode(obj.ino)
        obj.pinned = bool(rec and rec.oid == obj.oid and rec.pin)

    def drop_unsealed(self) -> int:
        """Remove the files of this session that were never sealed (the clean unmount's
        share of recovery); returns how many."""
        n = 0
        with self.index.write() as txn:
            for ino in self.unsealed:
                rec = txn.get_inode(ino)
                if rec is not None and stat.S_ISREG(rec.mode) and rec.oid is None:
                    txn.unlink(rec.parent, rec.name)
                    txn.del_inode(ino)
                    n += 1
        self.unsealed.clear()
        return n

    # ---- recovery -----------------------------------------------------------
    def recover(self, lost: list[Obj]) -> tuple[dict[str, int], list[Obj]]:
        """The full recovery, after ``ObjectStore.load`` (only when the running totals of
        kvfs.store.tally are not valid; otherwise ``tally.recover`` reads just the unsealed
        and RAM-only sets): drop names whose bytes did not survive, unsealed files, dangling
        entries.

        Returns counts and the objects no name refers to (free them with release_space).
        """
        lost_oids = {o.oid for o in lost}
        doomed: list[int] = []
        live: set[int] = set()
        live_oids: set[int] = set()
        for ino, rec in self.index.iter_inodes():
            if stat.S_ISREG(rec.mode):
                oid = rec.oid
                if rec.nlink == 0 or oid is None or oid in lost_oids or oid not in self.store.objs:
                    doomed.append(ino)
                    continue
                live_oids.add(oid)
                self.store.objs[oid].pinned = rec.pin
                self.sealed[ino] = self.store.objs[oid]
                self.prefix.add(rec)
            live.add(ino)
        dangling = [(p, n) for p, n, c in self.index.iter_dirents() if c not in live]
        unowned = [o for oid, o in self.store.objs.items() if oid not in live_oids]
        with self.index.write() as txn:
            for ino in doomed:
                txn.del_inode(ino)
            for p, n in dangling:
                txn.unlink(p, n)
            for obj in lost:
                txn.del_object(obj.oid)
            for obj in unowned:
                self.store.drop(txn, obj)
        counts = {"dropped_files": len(doomed), "dangling_names": len(dangling),
                  "lost_objects": len(lost), "unowned_objects": len(unowned)}
        return counts, unowned

    # ---- reads --------------------------------------------------------------
    def inode(self, ino: int) -> InodeRecord:
        rec = self.index.get_inode(ino) or self.orphans.get(ino)
        if rec is None:
            raise _err(errno.ENOENT)
        return rec

    def lookup(self, parent: int, name: bytes) -> int:
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG)
        ino = self.index.lookup(parent, name)
        if ino is None:
            raise _err(errno.ENOENT)
        return ino

    def find(self, parent: int, name: bytes) -> int | None:
        """``lookup`` that answers a missing name with None (ENAMETOOLONG still raises)."""
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG)
        return self.index.lookup(parent, name)

    def _names_up(self, ino: int) -> list[bytes]:
        """The names from ``ino`` up to the root (at most 4096; stops at a missing record)."""
        names = []
        for _ in range(4096):
            if ino == ROOT_INO:
                break
            rec = self.index.get_inode(ino)
            if rec is None:
                break
            names.append(rec.name)
            ino = rec.parent
        return names

    def top_of(self, ino: int) -> str:
        """The namespace of what lies in directory ``ino``: its top-level directory's name
        (``/`` for the root; what kvfs.telemetry.namespace_of gives for a path under it)."""
        hit = self._tops.get(ino)           # ids are never reused: only a directory rename moves it
        if hit is not None and hit[0] == self.dir_renames:
            return hit[1]
        names = self._names_up(ino)
        top = names[-1].decode("utf-8", "surrogateescape") if names else "/"
        if len(self._tops) >= 4096:
            self._tops.clear()
        self._tops[ino] = (self.dir_renames, top)
        return top

    def path_of(self, ino: int) -> str:
        names = self._names_up(ino)
        names.reverse()                 # no byte of a multi-byte UTF-8 sequence is b"/": decode once
        return "/" + b"/".join(names).decode("utf-8", "surrogateescape")

    # ---- namespace changes --------------------------------------------------
    def _check_new(self, txn: Txn, parent: int, name: bytes) -> InodeRecord:
        """The parent directory's record (a copy the caller may change and put back)."""
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG)
        if parent == ROOT_INO and name == CONTROL_NAME:
            raise _err(errno.EPERM, ".kvfs is reserved")
        prec = txn.get_inode(parent)
        if prec is None:
            raise _err(errno.ENOENT)
        if not stat.S_ISDIR(prec.mode):
            raise _err(errno.ENOTDIR)
        if txn.lookup(parent, name) is not None:
            raise _err(errno.EEXIST)
        return prec

    def make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, **extra) -> tuple[int, InodeRecord]:
        """Create a directory, file or symlink (mode carries the type)."""
        with self.index.write() as txn:
            prec = self._check_new(txn, parent, name)
            ino = txn.new_id(b"ino")
            now = time.time_ns()
            rec = InodeRecord(mode=mode, uid=uid, gid=gid, size=0, nlink=1, atime=now, mtime=now, ctime=now,
                              parent=parent, name=name, xattrs={}, **extra)
            if stat.S_ISLNK(mode):
                rec.size = len(extra["target"])
            if stat.S_ISDIR(mode):
                rec.subdirs = 0              # st_nlink 2 + subdirs (kvfs.fs.ops._entry)
                _count_subdir(prec, 1)
            txn.put_inode(ino, rec, new=True)
            txn.link(parent, name, ino, new=True)
            prec.mtime = prec.ctime = now
            txn.put_inode(parent, prec)
        if stat.S_ISREG(mode) and rec.oid is None:
            self.unsealed.add(ino)
        return ino, rec

    def _touch_dir(self, txn: Txn, ino: int, subdirs: int = 0) -> None:
        rec = txn.get_inode(ino)
        if rec is not None:
            rec.mtime = rec.ctime = time.time_ns()
            _count_subdir(rec, subdirs)
            txn.put_inode(ino, rec)

    def _remove(self, txn: Txn, parent: int, name: bytes, ino: int, rec: InodeRecord, keep_open: bool) -> Obj | None:
        """Remove one name and, with it, the inode and its object (unlink, rename over a
        name: the kernel made this change itself, so it is not told about it)."""
        txn.unlink(parent, name)
        txn.del_inode(ino)
        self.prefix.remove(rec, self.store.table_loaded)
        self.sealed.pop(ino, None)
        self.unsealed.discard(ino)
        if keep_open:
            rec.nlink = 0
            self.orphans[ino] = rec
        obj = self.store.objs.get(rec.oid)
        if obj is not None:
            self.store.drop(txn, obj)
        return obj

    def unlink(self, parent: int, name: bytes, is_open) -> Obj | None:
        with self.index.write() as txn:
            ino = txn.lookup(parent, name)
            if ino is None:
                raise _err(errno.ENOENT)
            rec = txn.get_inode(ino)
            if stat.S_ISDIR(rec.mode):
                raise _err(errno.EISDIR)
            obj = self._remove(txn, parent, name, ino, rec, is_open(ino))
            self._touch_dir(txn, parent)
        return obj

    def rmdir(self, parent: int, name: bytes) -> None:
        with self.index.write() as txn:
            ino = txn.lookup(parent, name)
            if ino is None:
                raise _err(errno.ENOENT)
            rec = txn.get_inode(ino)
            if not stat.S_ISDIR(rec.mode):
                raise _err(errno.ENOTDIR)
            self._remove_empty_dir(txn, parent, name, ino)
            self._touch_dir(txn, parent, -1)

    def _remove_empty_dir(self, txn: Txn, parent: int, name: bytes, ino: int) -> None:
        if txn.has_children(ino):
            raise _err(errno.ENOTEMPTY)
        txn.unlink(parent, name)
        txn.del_inode(ino)

    def rename(self, old_parent: int, old: bytes, new_parent: int, new: bytes, flags: int,
               is_open) -> Obj | None:
        if flags & ~1:                      # RENAME_NOREPLACE only; no EXCHANGE/WHITEOUT
            raise _err(errno.EINVAL)
        if len(new) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG)
        if new_parent == ROOT_INO and new == CONTROL_NAME:
            raise _err(errno.EPERM)
        dropped = None
        self.renames += 1
        with self.index.write() as txn:
            ino = txn.lookup(old_parent, old)
            if ino is None:
                raise _err(errno.ENOENT)
            rec = txn.get_inode(ino)
            prec = txn.get_inode(new_parent)
            if prec is None:
                raise _err(errno.ENOENT)
            if not stat.S_ISDIR(prec.mode):
                raise _err(errno.ENOTDIR)
            if stat.S_ISDIR(rec.mode):
                self.dir_renames += 1
                p = new_parent
                while True:                  # no moving a directory under itself
                    if p == ino:
                        raise _err(errno.EINVAL)
                    if p == ROOT_INO:
                        break
                    p = txn.get_inode(p).parent
            target = txn.lookup(new_parent, new)
            if target == ino:
                return None
            if target is not None:
                if flags & 1:
                    raise _err(errno.EEXIST)
                trec = txn.get_inode(target)
                if stat.S_ISDIR(trec.mode):
                    if not stat.S_ISDIR(rec.mode):
                        raise _err(errno.EISDIR)
                    self._remove_empty_dir(txn, new_parent, new, target)
                    _count_subdir(prec, -1)
                elif stat.S_ISDIR(rec.mode):
                    raise _err(errno.ENOTDIR)
                else:
                    dropped = self._remove(txn, new_parent, new, target, trec, is_open(target))
            txn.unlink(old_parent, old)
            txn.link(new_parent, new, ino, new=True)      # no name left there (removed above)
            now = time.time_ns()
            rec.parent, rec.name, rec.ctime = new_parent, new, now
            txn.put_inode(ino, rec)
            prec.mtime = prec.ctime = now
            moved_dir = stat.S_ISDIR(rec.mode) and new_parent != old_parent
            if moved_dir:
                _count_subdir(prec, 1)
            txn.put_inode(new_parent, prec)
            if new_parent != old_parent:
                self._touch_dir(txn, old_parent, -1 if moved_dir else 0)
        return dropped

    def publish(self, parent: int, name: bytes, mode: int, uid: int, gid: int, obj: Obj,
                kv: dict | None, noreplace: bool, is_open) -> tuple[InodeRecord, Obj | None]:
        """A new regular file ``parent/name`` pointing at the sealed ``obj`` (whose ``ino`` it
        gets), replacing a file there as ``rename`` would (EEXIST with ``noreplace``), in ONE
        transaction: after a crash the name is its old version or this one, never a temp
        file or an empty file. Returns (its record, the replaced file's object)."""
        with self.index.write() as txn:
            prec = txn.get_inode(parent)
            if prec is None:
                raise _err(errno.ENOENT)
            if not stat.S_ISDIR(prec.mode):
                raise _err(errno.ENOTDIR)
            dropped = None
            target = txn.lookup(parent, name)
            if target is not None:
                if noreplace:
                    raise _err(errno.EEXIST)
                trec = txn.get_inode(target)
                if stat.S_ISDIR(trec.mode):
                    raise _err(errno.EISDIR)
                dropped = self._remove(txn, parent, name, target, trec, is_open(target))
            now = time.time_ns()
            rec = InodeRecord(mode=stat.S_IFREG | (mode & 0o7777), uid=uid, gid=gid, size=obj.size, nlink=1,
                              atime=now, mtime=now, ctime=now, parent=parent, name=name, xattrs={},
                              oid=obj.oid, gen=1, kv=kv or None)
            self.prefix.add(rec)
            obj.pinned = False
            txn.put_object(obj.oid, obj.record(), old=None)        # a new object: nothing to read
            txn.put_inode(obj.ino, rec, new=True)                   # and a new inode
            txn.link(parent, name, obj.ino, new=True)
            prec.mtime = prec.ctime = now
            txn.put_inode(parent, prec)
        self.sealed[obj.ino] = obj
        return rec, dropped

    def update(self, ino: int, **fields) -> InodeRecord:
        """Set the record's ``fields`` (InodeRecord's field names) and its ctime; an orphan's
        record (unlinked, still open) is changed in place, without a ctime."""
        with self.index.write() as txn:
            rec = txn.get_inode(ino)
            if rec is None:
                rec = self.orphans.get(ino)
                if rec is None:
                    raise _err(errno.ENOENT)
                for k, v in fields.items():
                    setattr(rec, k, v)
                return rec
            for k, v in fields.items():
                setattr(rec, k, v)
            rec.ctime = time.time_ns()
            txn.put_inode(ino, rec)
        return rec

    def install(self, ino: int, obj: Obj, kv: dict | None, mtime: int | None = None) -> tuple[Obj | None, bool]:
        """Point a file at a newly sealed object (``mtime``: of its last write, or set after
        it; default now). Returns (old object, installed?)."""
        with self.index.write() as txn:
            rec = txn.get_inode(ino)
            if rec is None:                 # unlinked while it was being written
                self.store.drop(txn, obj)
                return None, False
            old = self.store.objs.get(rec.oid)
            if old is not None:
                self.store.drop(txn, old)
            self.prefix.remove(rec, self.store.table_loaded)
            now = time.time_ns()
            rec.oid, rec.size, rec.mtime, rec.ctime = obj.oid, obj.size, now if mtime is None else mtime, now
            rec.gen += 1
            rec.kv = kv or None
            self.prefix.add(rec)
            obj.pinned = rec.pin
            txn.put_object(obj.oid, obj.record(), old=None)        # a new object
            txn.put_inode(ino, rec)
        self.sealed[ino] = obj
        self.unsealed.discard(ino)
        return old, True

    def renew(self, ino: int) -> tuple[int, bytes, int] | None:
        """Give the name of sealed file ``ino`` a new inode holding the same version, in ONE
        transaction: the new inode gets ``ino``'s record (attributes, xattrs, pin, KV record)
        and its object (whose record now names the new inode), the directory entry points at
        it, and ``ino`` leaves the index: an orphan kept for its open descriptors, as after a
        rename over the name (``evicted``: a request by a name cannot mean it). After a crash
        the name is the old inode or the new one, with the same bytes. Returns (parent, name,
        new inode), or None when ``ino`` is not a named, sealed file of one name."""
        with self.index.write() as txn:
            rec = txn.get_inode(ino)
            if rec is None or not stat.S_ISREG(rec.mode) or rec.nlink != 1 or rec.oid is None:
                return None
            if txn.lookup(rec.parent, rec.name) != ino:
                return None
            obj = self.store.objs.get(rec.oid)
            orec = txn.get_object(rec.oid)
            if obj is None or obj.dead or orec is None:
                return None
            new = txn.new_id(b"ino")
            txn.put_inode(new, rec, new=True)
            txn.link(rec.parent, rec.name, new)        # the entry re-pointed (a new entry id)
            txn.del_inode(ino)
            txn.put_object(obj.oid, dataclasses.replace(orec, ino=new), old=orec)
        obj.ino = new
        self.sealed.pop(ino, None)
        self.sealed[new] = obj
        orphan = rec.copy()
        orphan.nlink = 0
        self.orphans[ino] = orphan
        self.evicted.add(ino)
        return rec.parent, rec.name, new

    def _lost(self, txn: Txn, obj: Obj) -> None:
        rec = txn.get_inode(obj.ino)
        if rec is not None and rec.oid == obj.oid:
            txn.unlink(rec.parent, rec.name)
            txn.del_inode(obj.ino)
            self.prefix.remove(rec, self.store.table_loaded)
            self.sealed.pop(obj.ino, None)
            if self.is_open(obj.ino):
                # a handle on another version of this inode (a reader of an older one): its
                # descriptor goes on as after an unlink
                rec.nlink = 0
                self.orphans[obj.ino] = rec
                self.evicted.add(obj.ino)
            self.on_name_removed(rec.parent, rec.name, obj.ino)

    # ---- xattrs stored with the file -----------------------------------------
    def set_user_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        with self.index.write() as txn:
            rec = txn.get_inode(ino)
            if rec is None:
                raise _err(errno.ENOENT)
            rec.xattrs[name] = value
            rec.ctime = time.time_ns()
            txn.put_inode(ino, rec)

    def remove_user_xattr(self, ino: int, name: bytes) -> None:
        with self.index.write() as txn:
            rec = txn.get_inode(ino)
            if rec is None:
                raise _err(errno.ENOENT)
            if name not in rec.xattrs:
                raise _err(errno.ENODATA)
            del rec.xattrs[name]
            txn.put_inode(ino, rec)
