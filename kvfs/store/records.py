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

_INT = frozenset((int,))
_NUM = frozenset((int, float))
_OPTINT = frozenset((int, type(None)))
_BYTES = frozenset((bytes,))
_STR = frozenset((str,))
_DICT = frozenset((dict,))
_BOOL = frozenset((bool,))

# (required fields, optional fields): field -> allowed exact types
INODE_FIELDS = (
    {"mode": _INT, "uid": _INT, "gid": _INT, "size": _INT, "nlink": _INT, "atime": _INT, "mtime": _INT,
     "ctime": _INT, "parent": _INT, "name": _BYTES, "xattrs": _DICT},
    {"oid": _OPTINT, "target": _BYTES, "pin": _BOOL, "gen": _INT, "kv": _DICT, "subdirs": _INT},
)
OBJECT_FIELDS = (
    {"size": _INT, "checksum": _INT, "chunk_size": _INT, "sums": _BYTES, "place": _DICT, "ino": _INT},
    {"key": _STR, "gen": _INT, "hits": _INT, "atime": _NUM},
)
META_FIELDS: tuple[dict, dict] = ({}, {})
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


def _decode(raw: bytes, fields: tuple[dict, dict], what: str) -> dict:
    try:
        rec = cbor2.loads(raw, tag_hook=_no_tags)
    except Exception as e:      # noqa: BLE001 - any decoding failure is a damaged record
        raise IndexDamaged(f"index record ({what}) does not parse: {e}; {FSCK_HINT}") from None
    if type(rec) is not dict:
        raise IndexDamaged(f"index record ({what}) is not a map; {FSCK_HINT}")
    required, optional = fields
    bad = None
    try:
        for name, types in required.items():
            if type(rec[name]) not in types:
                bad = name
                break
    except KeyError as e:
        raise IndexDamaged(f"index record ({what}) lacks {e.args[0]!r}; {FSCK_HINT}") from None
    if bad is None and len(rec) > len(required):
        for name, v in rec.items():
            if name in required:
                continue
            types = optional.get(name)
            if types is None:
                if not (type(name) is str and _plain(v)):
                    bad = name
                    break
            elif type(v) not in types:
                bad = name
                break
    if bad is None:
        for name, (kt, vt) in _MAPS.items():
            m = rec.get(name)
            if m and not all(type(k) is kt and type(x) is vt for k, x in m.items()):
                bad = name
                break
    if bad is not None:
        raise IndexDamaged(f"index record ({what}) has a bad field {str(bad)[:40]!r}; {FSCK_HINT}")
    return rec


_MISSING = object()
decoded = 0                 # inode and object records decoded by this process (recovery reports its share)


def decode_inode(raw: bytes) -> dict:
    global decoded
    decoded += 1
    return _decode(raw, INODE_FIELDS, "inode")


def decode_object(raw: bytes) -> dict:
    global decoded
    decoded += 1
    return _decode(raw, OBJECT_FIELDS, "object")


def decode_meta(raw: bytes) -> dict:
    """A meta map (format header): plain values only."""
    return _decode(raw, META_FIELDS, "meta")
