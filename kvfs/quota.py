"""Byte quotas per namespace (top-level directory of the mount).

Root sets one with ``setfattr -n user.kvfs.quota -v 10GiB MOUNT/NS`` (``kvfs quota set``); the
value ``none`` removes it. Quotas are kept in the index (meta key ``quotas``), so they survive
restarts. A write that would take a namespace past its quota first evicts that namespace's own
least-recently-used sealed files (not open, not leased, not pinned) down to QUOTA_LOW of the
quota, then fails with EDQUOT if it still does not fit. Usage is the namespace's sealed bytes
(kvfs.telemetry) plus the buffer of the file being written: other files being written at the
same moment are counted once they are sealed.
"""
from __future__ import annotations

import errno
import json
import logging

from kvfs.config import format_size, parse_size
from kvfs.errors import ConfigError, NamespaceError
from kvfs.store.index import ROOT_INO
from kvfs.telemetry import namespace_of

log = logging.getLogger(__name__)

XATTR = b"user.kvfs.quota"
META_KEY = b"quotas"
QUOTA_LOW = 0.95        # evicting for a write goes down to this share of the quota (batches)


class Quotas:
    def __init__(self, cache):
        self.cache = cache
        self.store = cache.store
        raw = cache.index.get_meta(META_KEY)
        self.limits: dict[str, int] = {str(k): int(v) for k, v in json.loads(raw).items()} if raw else {}
        self.store.shares.set_quotas(self.limits)    # eviction under pressure weighs by quota
        self.evicted = 0                # files evicted to make room within a quota
        self.refused = 0                # writes answered EDQUOT
        self._fh_ns: dict[int, str] = {}

    # ---- setting ----------------------------------------------------------------
    def namespace_dir(self, ino: int) -> str:
        """The namespace an inode names, if it is a top-level directory (EINVAL otherwise)."""
        rec = self.cache.ns.inode(ino)
        if rec.get("parent") != ROOT_INO or ino == ROOT_INO or not (rec["mode"] & 0o040000):
            raise NamespaceError(errno.EINVAL, "a quota is set on a top-level directory")
        return rec["name"].decode("utf-8", "surrogateescape")

    def set_xattr(self, ino: int, value: bytes, uid: int) -> None:
        if uid != 0:
            raise NamespaceError(errno.EPERM, "only root sets quotas")
        ns = self.namespace_dir(ino)
        text = value.decode("utf-8", "replace").strip()
        if text.lower() in ("none", ""):
            self.limits.pop(ns, None)
        else:
            try:
                self.limits[ns] = parse_size(text)
            except ConfigError:
                raise NamespaceError(errno.EINVAL, f"bad quota {text!r}") from None
        self.cache.index.put_meta(META_KEY, json.dumps(self.limits, sort_keys=True).encode())
        self.store.shares.set_quotas(self.limits)
        log.info("quota of %s: %s", ns, format_size(self.limits[ns]) if ns in self.limits else "none")

    def get_xattr(self, ino: int) -> bytes:
        limit = self.limits.get(self.namespace_dir(ino))
        if limit is None:
            raise NamespaceError(errno.ENODATA)
        return str(limit).encode()

    # ---- enforcing ------------------------------------------------------------------
    def forget_handle(self, fh: int) -> None:
        self._fh_ns.pop(fh, None)

    async def admit_write(self, fh: int, off: int, length: int) -> None:
        """Make room for a write of ``length`` bytes at ``off`` through ``fh``, or EDQUOT."""
        if not self.limits:
            return
        ns = self._fh_ns.get(fh)
        h = self.cache.handles.get(fh)
        if h is None:
            return
        if ns is None:
            ns = self._fh_ns[fh] = namespace_of(self.cache.ns.path_of(h.ino))
        limit = self.limits.get(ns)
        if limit is None:
            return
        ws = h.ws
        current = ws.staging.size if ws is not None and ws.staging is not None else 0
        growth = max(0, off + length - current)
        if not growth:
            return
        counters = self.store.telemetry.namespaces.get(ns)
        used = (counters.bytes if counters else 0) + current
        if used + growth <= limit:
            return
        victims = self._victims(ns, keep=ws.base if ws else None)
        if used - sum(o.size for o in victims) + growth > limit:   # cannot fit: evict nothing
            self.refused += 1
            raise NamespaceError(errno.EDQUOT, f"quota of {ns} ({format_size(limit)}) exceeded")
        need = used + growth - int(limit * QUOTA_LOW)
        freed = 0
        for obj in victims:
            if freed >= need:
                break
            if obj.dead or obj.refs or obj.busy:     # opened or moved while we evicted others
                continue
            await self.store.evict(obj)
            freed += obj.size
            self.evicted += 1
        counters = self.store.telemetry.namespaces.get(ns)
        if (counters.bytes if counters else 0) + current + growth > limit:
            self.refused += 1
            raise NamespaceError(errno.EDQUOT, f"quota of {ns} ({format_size(limit)}) exceeded")

    def _victims(self, ns: str, keep) -> list:
        """``ns``'s idle sealed files, least recently used first (prefix-aware: a block whose
        descendants are cached is kept, as under pressure)."""
        objs = self.store.objs
        mine = {oid: objs[oid] for lru in self.store.lru.values() for oid in lru.objects(ns) if oid in objs}
        return sorted((o for o in mine.values()
                       if not (o.refs or o.pinned or o.busy or o.dead or o is keep)
                       and self.store.may_evict(o)),
                      key=lambda o: o.atime)

    def statistics(self) -> dict:
        nss = self.store.telemetry.namespaces
        return {"limits": {ns: {"limit": lim, "used": nss[ns].bytes if ns in nss else 0}
                           for ns, lim in sorted(self.limits.items())},
                "evicted": self.evicted, "refused": self.refused}
