"""What a start after kill -9 needs, kept in the index's group commits (issue 12).

The ``recover`` database of the index holds, changed in the same ``Txn`` as the records
they describe (so every group commit carries them consistent with the records):

* ``u`` + ino: regular files created and not sealed yet (``Txn.put_inode``/``del_inode``
  keep it, for every writer);
* ``r`` + oid: objects with bytes but no durable copy (only in RAM: they die with the
  process);
* running totals, as functions of the object records: ``o`` (object count), ``t`` + tier
  (footprint bytes and objects on each durable tier), ``n`` + namespace (bytes and objects
  per namespace: telemetry and quota usage); ``Txn.put_object``/``del_object`` hand each
  change of an object record to ``Tally.object``, which adds the difference;
* ``k``: no KV child counts to rebuild, no inode's KV record names a parent (set by a full
  recovery that found none; any ``Txn.put_inode`` of a record with a KV record deletes it):
  a start after a crash then spares the background table scan (kvfs.store.objtable) the
  walk of every inode, as the clean-unmount marker's ``kv_parents`` does;
* ``v``: the totals are valid. A writer without a tally (fsck, a tool) that changes an
  object record deletes it, so the next start recounts everything.

A start after a crash (``Store.start``) then reads only these sets and the totals
(``recover``: the records it decodes are those of the sets), instead of every record; the
full consistency walk (dangling names, unowned objects) is ``kvfs fsck``'s.
"""
from __future__ import annotations

import logging
import stat
import struct
from typing import Callable

from kvfs.store import records
from kvfs.store.index import VALID, Index, Txn, k64
from kvfs.store.records import ObjectRecord
from kvfs.telemetry import namespace_of

log = logging.getLogger(__name__)

UNSEALED, RAM_ONLY, NO_KV = b"u", b"r", b"k"
OBJECTS, TIER, NAMESPACE = b"o", b"t", b"n"
_PAIR = struct.Struct(">qq")
_VERSION = b"1"


class Tally:
    """The running totals of one index (attached as ``index.tally`` by the object store)."""

    def __init__(self, index: Index, footprints: dict[str, Callable[[int], int]]):
        self.index = index
        self.footprints = footprints        # durable tier name -> footprint(size)
        # key -> [a, b, its 16 packed bytes]: the same bytearray goes into every Txn's changes,
        # so a group commit writes the value after all its operations (no packing per Txn)
        self.values: dict[bytes, list] = {}
        self._ns_keys: dict[str, bytes] = {}
        self.valid = False
        self.no_kv = False                  # known: no inode has a KV record
        index.commit()
        with index.env.begin() as t:
            for key, raw in t.cursor(db=index.recover):
                if key[:1] in (OBJECTS, TIER, NAMESPACE):
                    self.values[bytes(key)] = [*_PAIR.unpack(raw), bytearray(raw)]
                elif key == VALID:
                    self.valid = bytes(raw) == _VERSION
                elif key == NO_KV:
                    self.no_kv = True
        index.tally = self

    # ---- per record -------------------------------------------------------------
    def _contribution(self, rec: ObjectRecord | None, sign: int, d: dict) -> bool:
        """Add ``rec``'s share of the totals times ``sign`` to ``d``; whether it is RAM-only."""
        if rec is None:
            return False
        size = rec.size
        _add(d, OBJECTS, sign, 0)
        ns = namespace_of(rec.key)
        key = self._ns_keys.get(ns)
        if key is None:
            if len(self._ns_keys) > 4096:
                self._ns_keys.clear()
            key = self._ns_keys[ns] = NAMESPACE + ns.encode("utf-8", "surrogateescape")
        _add(d, key, sign * size, sign)
        durable = False
        for name in rec.place:
            fp = self.footprints.get(name)
            if fp is not None:
                durable = True
                _add(d, TIER + name.encode(), sign * fp(size), sign)
        return bool(size) and not durable

    def object(self, txn: Txn, oid: int, old: ObjectRecord | None, new: ObjectRecord | None) -> None:
        """An object record changes from ``old`` to ``new`` (None: absent) in ``txn``."""
        d = txn.d
        if d is None:
            d = txn.d = {}
        was = self._contribution(old, -1, d)
        now = self._contribution(new, 1, d)
        if was != now:
            txn.recover_set(RAM_ONLY + k64(oid), b"" if now else None)

    def apply(self, d: dict, txn: Txn) -> None:
        """A Txn's differences join the totals and its changes: written with it."""
        values = self.values
        for key, (a, b) in d.items():
            if not a and not b:
                continue
            v = values.get(key)
            if v is None:
                v = values[key] = [0, 0, bytearray(_PAIR.size)]
            v[0] += a
            v[1] += b
            _PAIR.pack_into(v[2], 0, v[0], v[1])
            txn.recover_set(key, v[2])

    # ---- whole totals ---------------------------------------------------------------
    def totals(self) -> dict:
        """The totals in the shape of the clean-unmount marker (kvfs.store.marker)."""
        tiers = {name: [0, 0] for name in self.footprints}
        namespaces = {}
        for key, (a, b, _raw) in self.values.items():
            if key[:1] == TIER and key[1:].decode() in tiers:
                tiers[key[1:].decode()] = [a, b]
            elif key[:1] == NAMESPACE and (a or b):
                namespaces[key[1:].decode("utf-8", "surrogateescape")] = [a, b]
        return {"objects": self.values.get(OBJECTS, [0])[0], "tiers": tiers, "namespaces": namespaces,
                "kv_parents": 0 if self.no_kv else -1}     # -1: not known (scan the inodes)

    def recount(self, recs) -> dict[bytes, list[int]]:
        """The totals of the object records ``recs`` (non-zero ones, as ``current`` gives)."""
        d: dict = {}
        for rec in recs:
            self._contribution(rec, 1, d)
        return {k: v for k, v in d.items() if v[0] or v[1]}

    def inconsistency(self) -> str | None:
        """What is wrong with the totals, checked against what LMDB counts without decoding a
        record (None: nothing found): the object count is the objects database's number of
        entries, and the namespaces' object counts add up to it; no total is negative. A
        start after a crash trusts the sets and totals only if this finds nothing."""
        self.index.commit()
        with self.index.env.begin() as t:
            entries = t.stat(self.index.objects)["entries"]
        count = self.values.get(OBJECTS, [0])[0]
        if count != entries:
            return f"the object count is {count}, the index holds {entries} object records"
        in_ns = sum(v[1] for k, v in self.values.items() if k[:1] == NAMESPACE)
        if in_ns != entries:
            return f"the namespaces count {in_ns} objects, the index holds {entries}"
        for key, (a, b, _raw) in self.values.items():
            if a < 0 or b < 0:
                return f"the running total {key!r} is negative ({a}, {b})"
        return None

    def current(self) -> dict[bytes, list[int]]:
        """The running totals (non-zero ones)."""
        return {k: v[:2] for k, v in self.values.items() if v[0] or v[1]}

    def note_kv(self, kv: bool) -> None:
        """Whether any inode's KV record names a parent, known from a complete table (the
        ``k`` key: set at a clean unmount whose scan found none, for the next crash start)."""
        with self.index.write() as txn:
            txn.recover_set(NO_KV, None if kv else b"")
        self.no_kv = not kv

    def reset(self, recs, kv: bool = True) -> None:
        """Recount from ``recs`` (every object record: after a full recovery) and mark valid;
        ``kv``: whether any inode has a KV record with a parent (the recovery's count)."""
        d = self.recount(recs)
        with self.index.write() as txn:
            txn.recover_set(NO_KV, None if kv else b"")
            self.no_kv = not kv
            for key in self.values:
                if key not in d:
                    txn.recover_set(key, None)
            self.values = {}
            d.setdefault(OBJECTS, [0, 0])
            self.apply(d, txn)
            txn.recover_set(VALID, _VERSION)
        self.valid = True


def invalidate(index: Index) -> None:
    """Forget the running totals: the next start recovers in full (a writer that changed
    records without keeping them, and tests that compare the two starts)."""
    with index.write() as txn:
        txn.recover_set(VALID, None)
    index.commit()


def _add(d: dict, key: bytes, a: int, b: int) -> None:
    v = d.get(key)
    if v is None:
        d[key] = [a, b]
    else:
        v[0] += a
        v[1] += b


def recover(index: Index, footprints, names: list | None = None) -> dict[str, int]:
    """After kill -9, with valid totals: drop the files never sealed and the objects whose
    only copy was in RAM (and the files that named them), touching only the records the two
    sets name. Returns counts, ``decoded``: records decoded. ``names`` gets each dropped
    file's (parent, name, inode): the kernel may still cache them when a supervised mount
    outlived the daemon (kvfs/supervisor.py)."""
    if names is None:
        names = []
    before = records.decoded
    index.commit()
    with index.env.begin() as t:
        keys = [bytes(k) for k in t.cursor(db=index.recover).iternext(values=False)
                if k[:1] in (UNSEALED, RAM_ONLY)]
    dropped = lost = 0
    with index.write() as txn:
        for key in keys:
            ident = struct.unpack(">Q", key[1:])[0]
            if key[:1] == UNSEALED:
                rec = txn.get_inode(ident)
                if rec is not None and stat.S_ISREG(rec.mode) and rec.oid is None:
                    names.append((rec.parent, rec.name, ident))
                    txn.unlink(rec.parent, rec.name)
                    txn.del_inode(ident)
                    dropped += 1
                txn.recover_set(key, None)          # also a stale entry (sealed or gone since)
                continue
            orec = txn.get_object(ident)
            if orec is not None and not any(n in footprints for n in orec.place):
                rec = txn.get_inode(orec.ino)
                if rec is not None and rec.oid == ident:
                    names.append((rec.parent, rec.name, orec.ino))
                    txn.unlink(rec.parent, rec.name)
                    txn.del_inode(orec.ino)
                    dropped += 1
                txn.put_object(ident, None, old=orec)      # deleted (the totals: no second read)
                lost += 1
            txn.recover_set(key, None)
    index.commit()
    return {"dropped_files": dropped, "lost_objects": lost, "decoded": records.decoded - before}


def check(index: Index, footprints) -> list[str]:
    """fsck's check of the sets and totals against every record (problems, one line each;
    none while the totals are not valid: the next start recounts them anyway)."""
    ours = Tally(index, footprints)
    index.tally = None                  # fsck's own repairs invalidate instead of keeping
    if not ours.valid:
        return []
    problems = []
    with index.env.begin() as t:
        keys = {bytes(k) for k in t.cursor(db=index.recover).iternext(values=False)}
    recs = []
    for oid, rec in index.iter_objects():
        recs.append(rec)
        if ours._contribution(rec, 0, {}) and RAM_ONLY + k64(oid) not in keys:
            problems.append(f"object {oid:x} has no durable copy but is not in the RAM-only set")
    for ino, rec in index.iter_inodes():
        if stat.S_ISREG(rec.mode) and rec.oid is None and UNSEALED + k64(ino) not in keys:
            problems.append(f"file {rec.name!r} (inode {ino}) is unsealed but not in the unsealed set")
        if NO_KV in keys and (rec.kv or {}).get("parent"):
            problems.append(f"file {rec.name!r} (inode {ino}) has a KV parent but the index says none has")
            keys.discard(NO_KV)
    have, want = ours.current(), ours.recount(recs)
    for key in sorted(set(have) | set(want)):
        if have.get(key, [0, 0]) != want.get(key, [0, 0]):
            problems.append(f"running total {key!r} is {have.get(key, [0, 0])}, the records say "
                            f"{want.get(key, [0, 0])}")
    return problems


def offline_losses(state_dir, limit: int = 10) -> dict:
    """What the next start of the index in ``state_dir`` will drop, read while no daemon holds
    it (a dead daemon's, for ``kvfs umount``), without opening it for writing: the files never
    sealed and the objects whose only copy was in RAM (with the files that name them).

    With valid totals these are the two sets a start after a crash reads (``recover``);
    without, that start walks every record, and so does this. Returns ``unsealed`` and
    ``ram_only`` counts, ``files`` (up to ``limit`` of the paths), ``from``: "tally" or
    "records". Raises OSError, lmdb.Error or IndexDamaged when the index cannot be read."""
    import lmdb

    from pathlib import Path

    from kvfs.protocol import ROOT_INO
    from kvfs.store.index import ENV_NAME
    from kvfs.store.lmdbfile import check_lmdb_file

    env_dir = Path(state_dir) / ENV_NAME
    check_lmdb_file(env_dir / "data.mdb")
    if not (env_dir / "data.mdb").exists():
        return {"unsealed": 0, "ram_only": 0, "files": [], "from": "records"}
    env = lmdb.open(str(env_dir), readonly=True, max_dbs=8, subdir=True, lock=True, readahead=False)
    try:
        inodes, objects, recover = (env.open_db(n, create=False)
                                    for n in (b"inodes", b"objects", b"recover"))
        with env.begin() as t:
            def inode(ino):
                raw = t.get(k64(ino), db=inodes)
                return None if raw is None else records.decode_inode(raw)

            def path_of(ino, rec) -> str:
                parts, seen = [], 0
                while rec is not None and ino != ROOT_INO and seen < 4096:
                    parts.append(rec.name.decode("utf-8", "surrogateescape"))
                    ino, rec, seen = rec.parent, inode(rec.parent), seen + 1
                return "/" + "/".join(reversed(parts))

            valid = bytes(t.get(VALID, db=recover) or b"") == _VERSION
            unsealed: list[tuple[int, object]] = []
            ram_only: list[tuple[int, object]] = []
            if valid:
                for key in t.cursor(db=recover).iternext(values=False):
                    kind, ident = key[:1], struct.unpack(">Q", key[1:])[0] if len(key) == 9 else None
                    if ident is None:
                        continue
                    if kind == UNSEALED:
                        rec = inode(ident)
                        if rec is not None and stat.S_ISREG(rec.mode) and rec.oid is None:
                            unsealed.append((ident, rec))
                    elif kind == RAM_ONLY:
                        raw = t.get(k64(ident), db=objects)
                        if raw is not None:
                            ram_only.append((ident, records.decode_object(raw)))
            else:
                for k, v in t.cursor(db=inodes):
                    rec = records.decode_inode(v)
                    if stat.S_ISREG(rec.mode) and rec.oid is None:
                        unsealed.append((struct.unpack(">Q", k)[0], rec))
                for k, v in t.cursor(db=objects):
                    orec = records.decode_object(v)
                    if orec.size and not any(n != "ram" for n in orec.place):
                        ram_only.append((struct.unpack(">Q", k)[0], orec))
            files = [path_of(ino, rec) for ino, rec in unsealed[:limit]]
            for oid, orec in ram_only:
                if len(files) >= limit:
                    break
                rec = inode(orec.ino)
                if rec is not None and rec.oid == oid:
                    files.append(path_of(orec.ino, rec))
    finally:
        env.close()
    return {"unsealed": len(unsealed), "ram_only": len(ram_only), "files": files,
            "from": "tally" if valid else "records"}
