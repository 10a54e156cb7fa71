"""Byte quotas per namespace (top-level directory of the mount).

Root sets one with ``setfattr -n user.kvfs.quota -v 10GiB MOUNT/NS`` (``kvfs quota set``); the
value ``none`` removes it. Quotas are kept in the index (meta key ``quotas``), so they survive
restarts. A write that would take a namespace past its quota fails with EDQUOT, evicting
nothing, if it could not fit even with all of that namespace's idle sealed files (not open, not
leased, not pinned) gone; otherwise it goes on, and when the file is closed the namespace's
least-recently-used idle files are evicted down to QUOTA_LOW of the quota (a write(2) reaches
the daemon in 1 MiB requests: evicting at the first one lost files for writes that then failed).
A file whose write got EDQUOT is itself evicted at close if its namespace is still over. Usage is the namespace's sealed bytes
(kvfs.telemetry), the bytes of its removed files still held open or leased (they stay in the
tiers until released: ``ObjectStore.held``), and the buffers of its files being written (every
one written through a handle in the namespace, until it is sealed: a tenant holding many files
open for writing is charged for all of them).
"""
from __future__ import annotations

import errno
import json
import logging

from kvfs.errors import ConfigError, NamespaceError
from kvfs.protocol import ROOT_INO
from kvfs.telemetry import namespace_of
from kvfs.units import format_size, parse_size

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
        self._owed: dict[int, str] = {}         # handles written past the quota on credit
        self._refused_fh: dict[int, str] = {}   # handles a write of which got EDQUOT
        # per namespace, the write states written through a handle there: their buffers
        # (unsealed bytes) are charged until sealed, however long their files stay open
        self._writing: dict[str, set] = {}

    # ---- setting ----------------------------------------------------------------
    def namespace_dir(self, ino: int) -> str:
        """The namespace an inode names, if it is a top-level directory (EINVAL otherwise)."""
        rec = self.cache.ns.inode(ino)
        if rec.parent != ROOT_INO or ino == ROOT_INO or not (rec.mode & 0o040000):
            raise NamespaceError(errno.EINVAL, "a quota is set on a top-level directory")
        return rec.name.decode("utf-8", "surrogateescape")

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
        self._owed.pop(fh, None)
        self._refused_fh.pop(fh, None)

    async def admit_write(self, fh: int, off: int, length: int, whole: bool = False) -> None:
        """Admit a write of ``length`` bytes at ``off`` through ``fh``, or EDQUOT (``whole``:
        nothing more will be written through ``fh``: make room now, not at its close)."""
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
        if ws is not None:
            self._writing.setdefault(ns, set()).add(ws)
        if not growth:
            return
        used = self._ns_bytes(ns) + self._buffered(ns, ws) + current
        if used + growth <= limit:
            return
        victims = self.store.policy.namespace_victims(ns, keep=ws.base if ws else None)
        if used - sum(o.size for o in victims) + growth > limit:   # cannot fit: evict nothing
            self.refused += 1
            self._refused_fh[fh] = ns
            raise NamespaceError(errno.EDQUOT, f"quota of {ns} ({format_size(limit)}) exceeded")
        if whole:           # the whole write is known (a commit entry): make room now
            await self._evict_down(ns, used + growth - int(limit * QUOTA_LOW), keep=ws.base if ws else None)
            if self._ns_bytes(ns) + self._buffered(ns, ws) + current + growth > limit:
                self.refused += 1
                raise NamespaceError(errno.EDQUOT, f"quota of {ns} ({format_size(limit)}) exceeded")
            return
        # it fits once idle files go, but a write(2) arrives in 1 MiB requests and may still
        # grow past the quota: evict them when the file is closed, not for a write that fails
        self._owed[fh] = ns

    async def admit_resize(self, ino: int, size: int) -> None:
        """Admit a truncate of ``ino`` to ``size``, or EDQUOT: growing a file adds its new bytes
        to the namespace as a write would (the sealed version is stored at its full size).
        The size is known, so room is made now (idle files evicted, as for a commit entry)."""
        if not self.limits:
            return
        ns = namespace_of(self.cache.ns.path_of(ino))
        limit = self.limits.get(ns)
        if limit is None:
            return
        files = self.cache.files
        growth = size - files.live_size(ino, self.cache.ns.inode(ino))
        if growth <= 0:
            return
        ws = files.writers.get(ino)
        used = self._ns_bytes(ns) + self._buffered(ns, None)
        if used + growth <= limit:
            return
        keep = self.cache.ns.sealed.get(ino)
        victims = self.store.policy.namespace_victims(ns, keep=keep)
        if used - sum(o.size for o in victims) + growth > limit:
            self.refused += 1
            raise NamespaceError(errno.EDQUOT, f"quota of {ns} ({format_size(limit)}) exceeded")
        await self._evict_down(ns, used + growth - int(limit * QUOTA_LOW), keep=keep)
        if self._ns_bytes(ns) + self._buffered(ns, None) + growth > limit:
            self.refused += 1
            raise NamespaceError(errno.EDQUOT, f"quota of {ns} ({format_size(limit)}) exceeded")
        if ws is not None:
            self._writing.setdefault(ns, set()).add(ws)

    async def settle(self, fh: int, ino: int | None) -> None:
        """At release of ``fh`` (after its seal): a file written on credit evicts its
        namespace's LRU idle files down to QUOTA_LOW of the quota; a file whose write was
        refused is evicted itself if its namespace is still over the quota (its partial
        bytes are not kept at the expense of idle files)."""
        ns = self._fh_ns.pop(fh, None)
        if ns is not None:
            self._buffered(ns, None)         # forget the write states sealed or gone
        owed, refused = self._owed.pop(fh, None), self._refused_fh.pop(fh, None)
        ns = refused or owed
        limit = self.limits.get(ns) if ns is not None else None
        if limit is None:
            return
        if refused is not None:
            obj = self.cache.ns.sealed.get(ino) if ino is not None else None
            if obj is not None and self._ns_bytes(ns) > limit and not (obj.refs or obj.busy or obj.dead):
                await self.store.mover.evict(obj)
                self.evicted += 1
            return
        if self._ns_bytes(ns) > limit:
            mine = self.cache.ns.sealed.get(ino) if ino is not None else None
            await self._evict_down(ns, self._ns_bytes(ns) - int(limit * QUOTA_LOW), keep=mine)

    async def _evict_down(self, ns: str, need: int, keep) -> None:
        """Evict ``ns``'s idle files, least recently used first, until ``need`` bytes are freed."""
        freed = 0
        for obj in self.store.policy.namespace_victims(ns, keep=keep):
            if freed >= need:
                break
            if obj.dead or obj.refs or obj.busy:     # opened or moved while we evicted others
                continue
            await self.store.mover.evict(obj)
            freed += obj.size
            self.evicted += 1

    def _buffered(self, ns: str, mine) -> int:
        """The buffers of ``ns``'s files being written other than ``mine`` (a write state):
        what its open, unsealed files hold in the tiers. A state whose buffer was sealed or
        discarded leaves the set; its next write through a handle adds it again."""
        states = self._writing.get(ns)
        if not states:
            return 0
        n = 0
        for ws in list(states):
            if ws.staging is None:
                states.discard(ws)
            elif ws is not mine:
                n += ws.staging.size
        if not states:
            del self._writing[ns]
        return n

    def _ns_bytes(self, ns: str) -> int:
        """What ``ns`` is charged: its sealed bytes, and the bytes of its removed files that
        a reader still holds (open or leased: they stay in the tiers until released)."""
        counters = self.store.telemetry.namespaces.get(ns)
        return (counters.bytes if counters else 0) + self.store.held.get(ns, 0)

    def statistics(self) -> dict:
        held = self.store.held
        return {"limits": {ns: {"limit": lim, "used": self._ns_bytes(ns), "held": held.get(ns, 0)}
                           for ns, lim in sorted(self.limits.items())},
                "evicted": self.evicted, "refused": self.refused}
