"""Extended attributes: user xattrs kept in the index and the read-only ``user.kvfs.*`` ones
computed from the object (tier, checksum, backing, ...): the ``xattrs`` member of ``Store``."""
from __future__ import annotations

import errno
import json
import logging
import stat
from typing import Callable

from kvfs.errors import NamespaceError
from kvfs.store import checksum
from kvfs.store.cred import ROOT, Cred
from kvfs.store.namespace import Namespace
from kvfs.store.objects import ObjectStore
from kvfs.store.owners import Owners
from kvfs.store.records import InodeRecord

log = logging.getLogger(__name__)

KV_PREFIX = b"user.kvfs."
XATTR_MAX = 64 * 1024


class Xattrs:
    """The xattr requests. ``dirty(ino)``: a write to ``ino`` is not sealed yet (FileHandles)."""

    def __init__(self, store: ObjectStore, ns: Namespace, owners: Owners, dirty: Callable[[int], bool]):
        self.store = store
        self.ns = ns
        self.owners = owners
        self.dirty = dirty

    # ---- xattrs -----------------------------------------------------------------
    def get(self, ino: int, name: bytes, cred: Cred = ROOT) -> bytes:
        value = self.find(ino, name, cred)
        if value is None:
            raise NamespaceError(errno.ENODATA)
        return value

    def find(self, ino: int, name: bytes, cred: Cred = ROOT) -> bytes | None:
        """The value, or None when the file has no such attribute (the kernel asks for
        ``security.capability`` before every write: a miss is the common answer)."""
        rec = self.ns.inode(ino)
        if name.startswith(KV_PREFIX):
            value = self._kv_xattr(ino, rec, name[len(KV_PREFIX):].decode("ascii", "replace"), cred)
            return None if value is None else value.encode()
        return rec.xattrs.get(name)

    def _kv_xattr(self, ino: int, rec: InodeRecord, key: str, cred: Cred = ROOT) -> str | None:
        if not stat.S_ISREG(rec.mode):
            return None
        obj = self.store.objs.get(rec.oid)
        kv = rec.kv or {}
        if key == "pin":
            return "1" if rec.pin else "0"
        if key == "tier":
            if self.dirty(ino):
                return self.store.ram.name
            return self.store.top_tier(obj) if obj else None
        if obj is None:
            return None
        if key == "checksum":
            return checksum.hexdigest(obj.checksum)
        if key == "hits":
            return str(obj.hits)
        if key == "atime":
            return f"{obj.atime:.3f}"
        if key in ("tokens", "parent", "hash", "namespace"):
            return kv.get(key) if kv else None
        if key == "backing":
            b = self.owners.backing_for(obj, cred)
            return None if b is None else json.dumps(b)
        return None

    def names(self, ino: int) -> list[bytes]:
        rec = self.ns.inode(ino)
        names = list(rec.xattrs)
        if stat.S_ISREG(rec.mode):
            names += [KV_PREFIX + k for k in (b"tier", b"checksum", b"pin", b"hits", b"atime")]
            if rec.kv:
                names += [KV_PREFIX + b"tokens", KV_PREFIX + b"parent"]
        return names

    def set(self, ino: int, name: bytes, value: bytes) -> None:
        rec = self.ns.inode(ino)
        if not name.startswith(b"user."):
            raise NamespaceError(errno.ENOTSUP)
        if name.startswith(KV_PREFIX):
            if name != KV_PREFIX + b"pin":
                raise NamespaceError(errno.EPERM, f"{name.decode()} is read-only")
            if not stat.S_ISREG(rec.mode):
                raise NamespaceError(errno.EINVAL)
            v = value.strip()
            if v not in (b"0", b"1"):
                raise NamespaceError(errno.EINVAL, "user.kvfs.pin takes 1 or 0")
            self.ns.update(ino, pin=v == b"1")
            obj = self.store.objs.get(rec.oid)
            if obj is not None:
                obj.pinned = v == b"1"
            return
        if len(value) > XATTR_MAX:
            raise NamespaceError(errno.E2BIG)
        self.ns.set_user_xattr(ino, name, value)

    def remove(self, ino: int, name: bytes) -> None:
        if name.startswith(KV_PREFIX):
            raise NamespaceError(errno.EPERM)
        self.ns.remove_user_xattr(ino, name)

