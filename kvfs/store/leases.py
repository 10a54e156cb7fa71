"""The control files' store side: the batched prefix lookup and fast-path leases (the
leased objects' backing locations, held where they are until released): the ``leases``
member of ``Store``."""
from __future__ import annotations

import dataclasses
import errno
import logging
import stat
import time

import trio

from kvfs.errors import NamespaceError
from kvfs.protocol import LEASE_TTL, LEASE_TTL_MAX, encode_lease_answer, encode_lease_entry, lookup_answer
from kvfs.store.cred import ROOT, Cred
from kvfs.store.index import ROOT_INO, Index
from kvfs.store.namespace import Namespace
from kvfs.store.objects import Obj, ObjectStore
from kvfs.store.owners import DAEMON_UID, Owners

log = logging.getLogger(__name__)

LEASE_TTL_MAX_USER = 60.0   # ... for a caller other than root
LEASES_PER_USER = 64        # live leases one non-root uid may hold (its oldest goes first)
LEASE_PIN_SHARE = 4         # a non-root uid pins at most 1/4 of the RAM tier's capacity
_LEASE_ENTRY_MEMO = 1 << 17  # lease entries remembered (JSON text per object and placement)


@dataclasses.dataclass(eq=False)
class Lease:
    """Objects held for a fast-path reader (their refs count, like open handles)."""

    id: int
    objs: list
    expires: float
    uid: int = 0
    pinned: int = 0             # bytes held


class Leases:
    """The batched prefix lookup and fast-path leases."""

    def __init__(self, index: Index, store: ObjectStore, ns: Namespace, owners: Owners):
        self.index = index
        self.store = store
        self.ns = ns
        self.owners = owners
        self.live: dict[int, Lease] = {}     # by lease id
        self._next_lease = 1
        self._lease_entries: dict[int, tuple[str, bytes, str]] = {}    # see lease_entry
        self._released: list[Obj] = []       # objects of leases dropped in sync code

    # ---- control and stats ------------------------------------------------------
    def prefix_objects(self, paths: list[bytes], base: bytes = b"", cred: Cred = ROOT) -> list[Obj]:
        """The sealed objects of the leading ``paths`` (relative to ``base``, itself relative
        to the root) that are sealed regular files; the first path that is not ends the prefix.
        One index read transaction; sealed-ness comes from memory, not from inode records.
        A caller other than root sees a file only if it could open it for reading through
        the mount (search permission on every directory on the way, read on the file)."""
        comps = [c for c in base.split(b"/") if c and c != b"."]
        rel = [p.strip(b"/") for p in paths]
        if cred.uid == 0:
            return resolve_prefix(self.index, comps, rel, self.ns.sealed)
        return self._prefix_objects_as(comps, rel, cred)

    def _prefix_objects_as(self, base: list[bytes], paths: list[bytes], cred: Cred) -> list[Obj]:
        searchable: dict[int, bool] = {}

        def enter(ino: int) -> bool:
            ok = searchable.get(ino)
            if ok is None:
                rec = self.index.get_inode(ino)
                ok = searchable[ino] = bool(rec) and stat.S_ISDIR(rec.mode) and cred.may(rec, 1)
            return ok

        def walk(ino: int, comps) -> int | None:
            for c in comps:
                if not c or c == b".":
                    continue
                if not enter(ino):
                    return None
                ino = self.index.lookup(ino, c)
                if ino is None:
                    return None
            return ino

        top = walk(ROOT_INO, base)
        out: list[Obj] = []
        if top is None:
            return out
        for p in paths:
            *dirs, name = p.split(b"/")
            parent = walk(top, dirs)
            if parent is None or not enter(parent):
                break
            ino = self.index.lookup(parent, name)
            obj = self.ns.sealed.get(ino) if ino is not None else None
            if obj is None or obj.dead:
                break
            rec = self.index.get_inode(ino)
            if rec is None or not cred.may(rec, 4):
                break
            out.append(obj)
        return out

    def prefix_answer(self, objs: list[Obj]) -> dict:
        """The lookup answer for the leading sealed objects of a chain: count and top tiers."""
        top = self.store.top_tier
        return lookup_answer(len(objs), [top(o) for o in objs])

    # ---- leases: the fast path's batched backing locations -------------------------
    def grant(self, paths: list[bytes], base: bytes = b"", ttl: float = LEASE_TTL,
                    cred: Cred = ROOT) -> tuple[int, bytes]:
        """Backing locations of the leading sealed ``paths``, held for the loader until
        ``release`` (or ``ttl`` seconds): while leased, an object is neither demoted,
        evicted nor freed (it counts as open). Each block counts a hit, like an open.
        Returns the lease id and the answer (JSON, see kvfs/fs/control.py).

        A caller other than root gets only what it could read through the mount, a ttl of
        at most LEASE_TTL_MAX_USER, at most LEASES_PER_USER live leases (a new one releases
        its oldest) and pins at most 1/LEASE_PIN_SHARE of the RAM tier: blocks past that
        are answered ``null`` (read them through the mount) and not held."""
        if not (0 < ttl <= LEASE_TTL_MAX):
            raise NamespaceError(errno.EINVAL, f"lease ttl out of range (0, {LEASE_TTL_MAX:g}]")
        objs = self.prefix_objects(paths, base, cred)
        budget = None
        if cred.uid != 0:
            ttl = min(ttl, LEASE_TTL_MAX_USER)
            mine = sorted((lz for lz in self.live.values() if lz.uid == cred.uid), key=lambda lz: lz.id)
            for old in mine[:max(0, len(mine) - LEASES_PER_USER + 1)]:
                self._drop(old.id)
            budget = self.store.ram.capacity // LEASE_PIN_SHARE - sum(
                lz.pinned for lz in self.live.values() if lz.uid == cred.uid)
        lease = Lease(self._next_lease, [], time.monotonic() + ttl, cred.uid)
        self._next_lease += 1
        entries = []
        for obj in objs:
            if budget is not None and obj.size > budget - lease.pinned:
                entries.append(encode_lease_entry(None))     # over this user's share: read through the mount
                continue
            obj.refs += 1
            lease.objs.append(obj)
            lease.pinned += obj.size
            self.store.note_open(obj)
            entries.append(self.lease_entry(obj, cred))
        self.live[lease.id] = lease
        answer = self.prefix_answer(objs)
        answer.update(lease=lease.id, ttl=ttl)
        return lease.id, encode_lease_answer(answer, entries)

    def _drop(self, lease_id: int) -> None:
        """Release a lease from sync code: its objects are freed by the next release_space."""
        lease = self.live.pop(lease_id, None)
        if lease is not None:
            for obj in lease.objs:
                obj.refs -= 1
            self._released.extend(lease.objs)

    def lease_entry(self, obj: Obj, cred: Cred = ROOT) -> str:
        """``obj``'s lease entry as JSON text: ``[tier, path, offset, size, checksum, direct]``
        (its highest available copy) or ``null`` (no fast path). Memoised per object and
        placement: a hot prefix is leased again and again. A caller other than the daemon's
        user gets a path only to its own namespace's blocks (kvfs/store/owners.py)."""
        if cred.uid not in (0, DAEMON_UID):
            return encode_lease_entry(self.owners.backing_for(obj, cred))
        copy = self.owners.fast_copy(obj)
        if copy is None:
            return "null"
        memo = self._lease_entries.get(obj.oid)
        if memo is not None and memo[:2] == (copy[0].name, copy[1]):
            return memo[2]
        text = encode_lease_entry(self.owners.backing_of(obj))
        if len(self._lease_entries) >= _LEASE_ENTRY_MEMO:
            self._lease_entries.clear()
        self._lease_entries[obj.oid] = (copy[0].name, copy[1], text)
        return text

    async def release(self, lease_id: int) -> bool:
        lease = self.live.pop(lease_id, None)
        if lease is not None:
            for obj in lease.objs:
                obj.refs -= 1
                await self.store.release_space(obj)
        while self._released:
            await self.store.release_space(self._released.pop())
        return lease is not None

    async def expire(self) -> int:
        now = time.monotonic()
        old = [lid for lid, lease in self.live.items() if lease.expires <= now]
        for lid in old:
            log.debug("lease %d expired", lid)
            await self.release(lid)
        if self._released:
            await self.release(-1)
        return len(old)

    async def serve(self, interval: float = 1.0) -> None:
        """Background task: release leases whose holder neither released nor closed them."""
        while True:
            await trio.sleep(interval)
            await self.expire()


def resolve_prefix(index: Index, base: list[bytes], paths: list[bytes], sealed: dict) -> list:
    """Resolve ``paths`` (``/``-separated, relative to the directory ``base``, a list of
    components from the root) in order, in one read txn (``Index.resolve``), and map each
    inode through ``sealed`` (ino -> object) until the first that is missing, not in
    ``sealed``, or whose object is ``dead``. Returns the objects of the leading paths."""
    out: list = []
    found = index.resolve(base, paths)
    try:
        for ino in found:
            v = sealed.get(ino)
            if v is None or v.dead:
                break
            out.append(v)
    finally:
        found.close()               # ends the read transaction now, not when collected
    return out
