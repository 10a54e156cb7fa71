"""Names for the fs layer: lookups, directories and symlinks, and the namespace changes that
free bytes (unlink, rename) with the KV events of what they removed (kvfs.events); the
``names`` member of ``Store``."""
from __future__ import annotations

from typing import Awaitable, Callable

from kvfs.store.index import Index
from kvfs.store.namespace import Namespace
from kvfs.store.objects import Obj, ObjectStore
from kvfs.store.records import InodeRecord


class NameOps:
    """``is_open``: FileHandles' (a name removed while its file is open keeps an orphan);
    ``grants_follow_rename``: Owners' (a rename between namespaces takes back grants)."""

    def __init__(self, index: Index, store: ObjectStore, ns: Namespace, is_open: Callable[[int], bool],
                 grants_follow_rename: Callable[[int, int], None]):
        self.index = index
        self.store = store
        self.ns = ns
        self.is_open = is_open
        self.grants_follow_rename = grants_follow_rename
        self.telemetry = store.telemetry
        # (new parent, new name) after a rename: a shared volume republishes the moved block
        self.on_renamed: Callable[[int, bytes], Awaitable[None]] | None = None

    def find(self, parent: int, name: bytes) -> int | None:
        """The inode ``name`` names in directory ``parent``, or None."""
        return self.ns.find(parent, name)

    def inode(self, ino: int) -> InodeRecord:
        return self.ns.inode(ino)

    def top_of(self, ino: int) -> str:
        return self.ns.top_of(ino)

    def make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, **extra) -> tuple[int, InodeRecord]:
        """A directory or symlink (files come from ``FileHandles.create``)."""
        return self.ns.make(parent, name, mode, uid, gid, **extra)

    def rmdir(self, parent: int, name: bytes) -> None:
        self.ns.rmdir(parent, name)

    def entries(self, dir_ino: int, start_id: int):
        """``(entry id, name, inode, record)`` of directory ``dir_ino`` after ``start_id``."""
        for eid, name, ino in self.index.readdir(dir_ino, start_id):
            rec = self.index.get_inode(ino)
            if rec is not None:
                yield eid, name, ino, rec

    def evicted(self, ino: int) -> bool:
        """Inode ``ino`` lost its name by the daemon's doing (evicted, or renewed: ``renew``)
        and is kept only for descriptors opened before: a new request by a name cannot mean it."""
        return ino in self.ns.evicted

    def dropped(self, ino: int) -> bool:
        """Inode ``ino`` has no name any more though the kernel may still name it: the daemon
        removed it (eviction), or it lives on only for open descriptors (an orphan: unlinked,
        renamed over or renewed). A request by a name for it then came through a dentry the
        kernel looked up before the change (an open racing a ``rename`` over the name): ESTALE
        makes the kernel look the name up again, where ENOENT would fail an open of a name
        that existed throughout."""
        return ino in self.ns.evicted or ino in self.ns.orphans or self.index.get_inode(ino) is None

    def renew(self, ino: int) -> tuple[int, bytes, int] | None:
        """Give open file ``ino``'s name a new inode holding the same sealed version, ``ino``
        kept as an orphan for its descriptors (Namespace.renew). Returns (parent, name, new
        inode), or None where that cannot be done (not a sealed file of one name, not open)."""
        if not self.is_open(ino):
            return None
        return self.ns.renew(ino)

    def inode_count(self) -> int:
        return self.index.counts()["inodes"]

    def on_names_removed(self, callback) -> None:
        """``callback(parent, name)`` for each name the daemon removes by itself."""
        self.ns.on_name_removed = callback

    # ---- namespace changes that free bytes ---------------------------------
    async def unlink(self, parent: int, name: bytes) -> None:
        gone = self.describe_name(parent, name)
        obj = self.ns.unlink(parent, name, self.is_open)
        if obj is not None:
            self.removed(obj, gone)
            await self.store.release_space(obj)

    async def rename(self, op: int, old: bytes, np: int, new: bytes, flags: int) -> None:
        gone = self.describe_name(np, new)
        obj = self.ns.rename(op, old, np, new, flags, self.is_open)
        self.grants_follow_rename(op, np)
        if obj is not None:
            self.removed(obj, gone)
            await self.store.release_space(obj)
        if self.on_renamed is not None:
            await self.on_renamed(np, new)

    # ---- KV events (kvfs.events): what a removed name was -----------------------
    def describe(self, obj: Obj) -> tuple[str, dict | None]:
        rec = self.index.get_inode(obj.ino)
        if rec is None or rec.oid != obj.oid:
            return obj.key, None
        return self.ns.path_of(obj.ino), rec.kv

    def describe_name(self, parent: int, name: bytes) -> tuple[str, dict | None] | None:
        """Path and KV record of ``parent/name`` while it still exists (only with readers)."""
        if not self.telemetry.events.active:
            return None
        ino = self.index.lookup(parent, name)
        rec = self.index.get_inode(ino) if ino is not None else None
        if rec is None:
            return None
        return self.ns.path_of(ino), rec.kv

    def removed(self, obj: Obj, gone: tuple[str, dict | None] | None) -> None:
        path, kv = gone if gone is not None else (obj.key, None)
        self.telemetry.events.emit("removed", obj, None, path=path, kv=kv or {})
