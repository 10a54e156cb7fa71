"""Typed, versioned index records: CBOR maps checked field by field on the way in.

Every LMDB value the index stores is one of these records. Decoding never runs code
(CBOR, not pickle) and a record whose fields are missing or of the wrong type raises
``IndexDamaged``, so a planted or damaged value is refused with one line naming
``kvfs fsck`` instead of reaching the store. The format version lives in the index's
``format`` meta record and in a sidecar header file beside it (see kvfs.store.index).
"""
from __future__ import annotations

import cbor2

from kvfs.errors import IndexDamaged

FORMAT_VERSION = 2          # 1 was pickle (no longer read); 2 is CBOR records
FSCK_HINT = "run `kvfs fsck --repair` to rebuild it from the tiers"

_Int = (int,)
_Num = (int, float)
_OptInt = (int, type(None))

INODE_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    # field: (types, required)
    "mode": (_Int, True), "uid": (_Int, True), "gid": (_Int, True), "size": (_Int, True),
    "nlink": (_Int, True), "atime": (_Int, True), "mtime": (_Int, True), "ctime": (_Int, True),
    "parent": (_Int, True), "name": ((bytes,), True), "xattrs": ((dict,), True),
    "oid": (_OptInt, False), "target": ((bytes,), False), "pin": ((bool,), False),
    "gen": (_Int, False), "kv": ((dict,), False),
}
OBJECT_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "size": (_Int, True), "checksum": (_Int, True), "chunk_size": (_Int, True),
    "sums": ((bytes,), True), "place": ((dict,), True), "ino": (_Int, True),
    "key": ((str,), False), "gen": (_Int, False), "hits": (_Int, False), "atime": (_Num, False),
}
# maps inside records: field -> (key type, value type)
_MAPS = {"xattrs": (bytes, bytes), "kv": (str, str), "place": (str, bytes)}
_PLAIN = (int, float, str, bytes, bool, type(None))


def _no_tags(decoder, tag):
    raise ValueError(f"CBOR tag {tag.tag} is not allowed in index records")


def _plain(v, depth: int = 0) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if depth > 4:
        return False
    if isinstance(v, list):
        return all(_plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, (str, bytes, int)) and _plain(x, depth + 1) for k, x in v.items())
    return False


def encode(rec: dict) -> bytes:
    return cbor2.dumps(rec)


def _decode(raw: bytes, fields: dict, what: str) -> dict:
    try:
        rec = cbor2.loads(raw, tag_hook=_no_tags)
    except Exception as e:      # noqa: BLE001 - any decoding failure is a damaged record
        raise IndexDamaged(f"index record ({what}) does not parse: {e}; {FSCK_HINT}") from None
    if not isinstance(rec, dict):
        raise IndexDamaged(f"index record ({what}) is not a map; {FSCK_HINT}")
    for name, (types, required) in fields.items():
        v = rec.get(name, _MISSING)
        if v is _MISSING:
            if required:
                raise IndexDamaged(f"index record ({what}) lacks {name!r}; {FSCK_HINT}")
            continue
        if not isinstance(v, types):
            raise IndexDamaged(f"index record ({what}) has a bad {name!r}; {FSCK_HINT}")
        kv = _MAPS.get(name)
        if kv and not all(isinstance(k, kv[0]) and isinstance(x, kv[1]) for k, x in v.items()):
            raise IndexDamaged(f"index record ({what}) has a bad {name!r} map; {FSCK_HINT}")
    for name, v in rec.items():
        if name not in fields and not (isinstance(name, str) and _plain(v)):
            raise IndexDamaged(f"index record ({what}) has an unexpected field; {FSCK_HINT}")
    return rec


_MISSING = object()


def decode_inode(raw: bytes) -> dict:
    return _decode(raw, INODE_FIELDS, "inode")


def decode_object(raw: bytes) -> dict:
    return _decode(raw, OBJECT_FIELDS, "object")


def decode_meta(raw: bytes) -> dict:
    """A meta map (format header): plain values only."""
    return _decode(raw, {}, "meta")
