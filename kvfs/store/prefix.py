"""The prefix rule of eviction: a KV block file whose descendants are cached stays, so a
chain of blocks loses its tail, never its head.

The rule counts, per (namespace, block hash), the cached KV blocks whose parent is that
block: the namespace adds and removes a count as KV block files are named and unnamed, the
store's background scan (kvfs.store.objtable) adds those of a clean mount's records. The
placement policy (kvfs.store.policy) asks ``may_evict`` before it evicts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvfs.store.index import Index
from kvfs.store.records import InodeRecord

if TYPE_CHECKING:
    from kvfs.store.objects import Obj


class PrefixRule:
    def __init__(self, index: Index):
        self.index = index
        # (namespace, hash) -> number of cached child blocks
        self.children: dict[tuple[str, str], int] = {}

    def add(self, rec: InodeRecord) -> None:
        """Count the KV block of inode record ``rec`` (if it is one) as its parent's child."""
        kv = rec.kv
        if kv and kv.get("parent"):
            k = (kv["namespace"], kv["parent"])
            self.children[k] = self.children.get(k, 0) + 1

    def remove(self, rec: InodeRecord, complete: bool) -> None:
        """Uncount the KV block of ``rec``. ``complete``: every record has been counted (the
        store's scan is done); before that a count may go below zero, the scan adds it later."""
        kv = rec.kv
        if kv and kv.get("parent"):
            k = (kv["namespace"], kv["parent"])
            n = self.children.get(k, 0) - 1
            if n > 0 or (n < 0 and not complete):
                self.children[k] = n
            else:
                self.children.pop(k, None)

    def may_evict(self, obj: Obj) -> bool:
        """False for a KV block that has cached children."""
        rec = self.index.get_inode(obj.ino)
        kv = rec.kv if rec else None
        return not kv or self.children.get((kv["namespace"], kv["hash"]), 0) == 0
