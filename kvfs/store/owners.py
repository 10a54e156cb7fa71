"""Which caller may be handed which backing file: the ``owners`` member of ``Store``.

The daemon's user (and root) get the object's own file, as before. A namespace's owner (the
uid of a top-level directory, when that is not the daemon's user) gets its own name of the
file (kvfs/store/ownerlinks.py), made when first asked for. Anyone else gets no path
(``null`` in a lease, no ``user.kvfs.backing``) and reads through the mount. Callers reach
this only for files they could open through the mount (the lease checks every path as the
caller; ``user.kvfs.backing`` is read-checked by the kernel), so a path is never handed to a
process that could not read the block through the mount.

Grants are taken back when the rule that gave them stops holding: when a top-level directory
changes owner, when a rename moves something between namespaces (every grant is checked
again: O(grants)), and when a file with a grant changes mode or owner (its grants go; the
next lease grants again if the owner may still read it).
"""
from __future__ import annotations

import logging
import os

from kvfs.store import checksum
from kvfs.store.cred import ROOT, Cred
from kvfs.store.index import ROOT_INO, Index
from kvfs.store.namespace import Namespace
from kvfs.store.objects import Obj, ObjectStore
from kvfs.store.records import InodeRecord
from kvfs.store.tier import Tier
from kvfs.telemetry import namespace_of

log = logging.getLogger(__name__)

DAEMON_UID = os.geteuid()


class Owners:
    """Where the fast path reads an object, the rule for who gets that path, and the taking
    back of owners' grants."""

    def __init__(self, index: Index, store: ObjectStore, ns: Namespace):
        self.index = index
        self.store = store
        self.ns = ns

    def fast_copy(self, obj: Obj) -> tuple[Tier, bytes] | None:
        """The copy the fast path reads: ``obj``'s highest copy on an available tier."""
        for t in self.store.tiers:
            if t.name in obj.place and t.available:
                return t, obj.place[t.name]
        return None

    def backing_of(self, obj: Obj) -> dict | None:
        """Where the fast path reads ``obj``: its highest available copy, if that tier has
        a location a loader can read (tmpfs or NVMe file); None otherwise."""
        copy = self.fast_copy(obj)
        b = copy and copy[0].backing(obj.oid, copy[1])
        if not b:
            return None
        return dict(b, tier=copy[0].name, size=obj.size, checksum=checksum.hexdigest(obj.checksum))

    def namespace_owner(self, obj: Obj) -> int | None:
        """The owner of ``obj``'s namespace: the uid of its top-level directory when that
        is neither root nor the daemon's user; None otherwise (files at the root too)."""
        ino = obj.ino
        if self.index.get_inode(ino) is None:
            return None
        ns = namespace_of(self.ns.path_of(ino))
        if ns == "/":
            return None
        top = self.index.lookup(ROOT_INO, ns.encode("utf-8", "surrogateescape"))
        rec = self.index.get_inode(top) if top is not None else None
        uid = rec.uid if rec is not None else 0
        return None if uid in (0, DAEMON_UID) else uid

    def backing_for(self, obj: Obj, cred: Cred = ROOT) -> dict | None:
        """Where ``cred`` may read ``obj`` beside the mount, or None (see the module doc)."""
        if cred.uid in (0, DAEMON_UID):
            return self.backing_of(obj)
        if self.namespace_owner(obj) != cred.uid:
            return None
        copy = self.fast_copy(obj)
        if copy is None:
            return None
        b = copy[0].grant_read(obj.oid, copy[1], cred.uid)
        if not b:
            return None
        return dict(b, tier=copy[0].name, size=obj.size, checksum=checksum.hexdigest(obj.checksum))

    def revoke_grants(self, obj: Obj) -> None:
        for t in self.store.tiers:
            if obj.oid in t.granted():
                t.revoke_read(obj.oid)

    def recheck_grants(self) -> int:
        """Take back every grant whose holder no longer owns the object's namespace."""
        n = 0
        for t in self.store.tiers:
            for oid, uids in list(t.granted().items()):
                obj = self.store.objs.get(oid)
                owner = self.namespace_owner(obj) if obj is not None and not obj.dead else None
                for uid in list(uids):
                    if uid != owner:
                        t.revoke_read(oid, uid)
                        n += 1
        if n:
            log.info("took back %d backing-file grants (owner or namespace changed)", n)
        return n

    def grants_follow_setattr(self, ino: int, rec: InodeRecord, owner_changed: bool, mode_changed: bool) -> None:
        """After a chown/chmod: a top-level directory's new owner takes its namespace's
        grants away from the old one; a file's grants go when its mode or owner changes."""
        if not (owner_changed or mode_changed) or not any(t.granted() for t in self.store.tiers):
            return
        if rec.parent == ROOT_INO and owner_changed:
            self.recheck_grants()
            return
        obj = self.store.objs.get(rec.oid)
        if obj is not None:
            self.revoke_grants(obj)

    def grants_follow_rename(self, op: int, np: int) -> None:
        """After a rename: grants are checked again when it may have changed a namespace."""
        if op == np or not any(t.granted() for t in self.store.tiers):
            return
        if op == ROOT_INO or np == ROOT_INO or (
                namespace_of(self.ns.path_of(op) + "/x") != namespace_of(self.ns.path_of(np) + "/x")):
            self.recheck_grants()
