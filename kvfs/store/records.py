"""Typed, versioned index records: CBOR maps checked field by field on the way in.

Every LMDB value the index stores is one of these records. Decoding never runs code
(CBOR, not pickle) and a record whose fields are missing or of the wrong type raises
``IndexDamaged``, so a planted or damaged value is refused with one line naming
``kvfs fsck`` instead of reaching the store. The format version lives in the index's
``format`` meta record and in a sidecar header file beside it (see kvfs.store.index).

Inode and object records are decoded here once into ``InodeRecord`` / ``ObjectRecord``
(slotted dataclasses: attribute access, a misspelt field is an AttributeError at its first
run and a finding of any checker) and encoded back here into the same CBOR maps: the
same field names, optional fields written only when they hold something other than
their default, and fields this version does not know (a later version's) kept as they
came (``extra``).
"""
from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(slots=True, eq=True)
class InodeRecord:
    """An inode's record. ``oid``: a regular file's sealed object (None: not sealed yet);
    ``target``: a symlink's; ``subdirs``: a directory's subdirectory count (None: not
    counted, st_nlink 1); ``kv``: the KV block header of a sealed block (None: none)."""
    mode: int
    uid: int
    gid: int
    size: int
    nlink: int
    atime: int
    mtime: int
    ctime: int
    parent: int
    name: bytes
    xattrs: dict
    oid: int | None = None
    target: bytes | None = None
    pin: bool = False
    gen: int = 0
    kv: dict | None = None
    subdirs: int | None = None
    extra: dict | None = None       # fields of a later version, kept as they came

    def copy(self) -> "InodeRecord":
        """A copy the caller may change (its own ``xattrs`` map; ``kv`` is replaced, never changed)."""
        return InodeRecord(self.mode, self.uid, self.gid, self.size, self.nlink, self.atime, self.mtime,
                           self.ctime, self.parent, self.name, self.xattrs.copy(), self.oid, self.target,
                           self.pin, self.gen, self.kv, self.subdirs, self.extra)

    def to_map(self) -> dict:
        m = {"mode": self.mode, "uid": self.uid, "gid": self.gid, "size": self.size, "nlink": self.nlink,
             "atime": self.atime, "mtime": self.mtime, "ctime": self.ctime, "parent": self.parent,
             "name": self.name, "xattrs": self.xattrs}
        if self.oid is not None:
            m["oid"] = self.oid
        if self.target is not None:
            m["target"] = self.target
        if self.pin:
            m["pin"] = True
        if self.gen:
            m["gen"] = self.gen
        if self.kv is not None:
            m["kv"] = self.kv
        if self.subdirs is not None:
            m["subdirs"] = self.subdirs
        if self.extra:
            m.update(self.extra)
        return m


@dataclasses.dataclass(slots=True, eq=True)
class ObjectRecord:
    """A sealed object's record: its placement (tier name -> location) and checksums."""
    size: int
    checksum: int
    chunk_size: int
    sums: bytes
    place: dict
    ino: int
    key: str = ""
    gen: int = 0
    hits: int = 0
    atime: float = 0.0
    extra: dict | None = None       # fields of a later version, kept as they came

    def to_map(self) -> dict:
        m = {"size": self.size, "checksum": self.checksum, "chunk_size": self.chunk_size, "sums": self.sums,
             "place": self.place, "ino": self.ino, "key": self.key, "gen": self.gen, "hits": self.hits,
             "atime": self.atime}
        if self.extra:
            m.update(self.extra)
        return m


def encode(rec) -> bytes:
    """A record's CBOR map (an ``InodeRecord``, an ``ObjectRecord`` or a meta map)."""
    if type(rec) is not dict:
        rec = rec.to_map()
    return cbor2.dumps(rec)


def _decode(raw: bytes, fields: tuple[dict, dict], what: str) -> tuple[dict, dict | None]:
    """The checked map, and its fields this version does not know (None: none)."""
    try:
        rec = cbor2.loads(raw, tag_hook=_no_tags)
    except Exception as e:      # noqa: BLE001 - any decoding failure is a damaged record
        raise IndexDamaged(f"index record ({what}) does not parse: {e}; {FSCK_HINT}") from None
    if type(rec) is not dict:
        raise IndexDamaged(f"index record ({what}) is not a map; {FSCK_HINT}")
    required, optional = fields
    bad = extra = None
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
                if extra is None:
                    extra = {}
                extra[name] = v
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
    return rec, extra


_MISSING = object()
decoded = 0                 # inode and object records decoded by this process (recovery reports its share)


def decode_inode(raw: bytes) -> InodeRecord:
    global decoded
    decoded += 1
    m, extra = _decode(raw, INODE_FIELDS, "inode")
    g = m.get
    return InodeRecord(m["mode"], m["uid"], m["gid"], m["size"], m["nlink"], m["atime"], m["mtime"], m["ctime"],
                       m["parent"], m["name"], m["xattrs"], g("oid"), g("target"), g("pin", False), g("gen", 0),
                       g("kv"), g("subdirs"), extra)


def decode_object(raw: bytes) -> ObjectRecord:
    global decoded
    decoded += 1
    m, extra = _decode(raw, OBJECT_FIELDS, "object")
    g = m.get
    return ObjectRecord(m["size"], m["checksum"], m["chunk_size"], m["sums"], m["place"], m["ino"], g("key", ""),
                        g("gen", 0), g("hits", 0), g("atime", 0.0), extra)


def decode_meta(raw: bytes) -> dict:
    """A meta map (format header): plain values only."""
    return _decode(raw, META_FIELDS, "meta")[0]
