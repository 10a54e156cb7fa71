"""What the daemon and its clients agree on: the ``.kvfs`` control names, the control files'
request grammar (built for clients, parsed for the daemon) and answers (encoded for the
daemon), the lease-entry codec and the alignment of block payloads.

The fs layer (kvfs/fs/control.py and commitctl.py, which document the grammar) serves these;
the kv layer, the integrations and the CLI speak them. Neither side spells them itself.

A request is UTF-8 lines; a line starting with NUL (never in a path) is a directive:
``\\0base DIR``, ``\\0ttl SECONDS`` (lease only) or ``\\0release`` (lease only).

A lease entry, per leased file, is ``[tier, path, offset, size, xxh3_64 hex, direct]`` or
``null`` (no fast path); the ``user.kvfs.backing`` xattr carries the same fields as a JSON
object. Both decode through ``valid_backing``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct

import xxhash

log = logging.getLogger(__name__)

# ---- names -------------------------------------------------------------------------------
CONTROL_NAME = ".kvfs"                  # the reserved directory at the mount root
CONTROL_NAME_B = CONTROL_NAME.encode()
STATS_FILE = "stats"
LOOKUP_FILE = "lookup"
LEASE_FILE = "lease"
EVENTS_FILE = "events"
COMMIT_FILE = "commit"
GET_FILE = "get"
BACKING_XATTR = "user.kvfs.backing"
UNMOUNT_REPORT = "unmount.json"         # in the state directory: what the last clean unmount kept
UNMOUNT_REPORT_KEY = "unmount_report"   # in .kvfs/stats: this daemon writes UNMOUNT_REPORT
ROOT_INO = 1                            # the mount root's inode (FUSE's root node id)

# ---- alignment ---------------------------------------------------------------------------
ALIGN = 4096        # O_DIRECT unit: block payload offsets, NVMe object placement, read buffers

# ---- request grammar ---------------------------------------------------------------------
DIRECTIVE = b"\0"
BASE = b"base"
TTL = b"ttl"
RELEASE = b"release"
FD = b"fd"               # commit: the caller's descriptor holding the bytes of later entries
MEM = b"mem"             # commit: later entries' offsets are addresses in the caller's memory
MODE = b"mode"           # commit: permission bits of later entries (octal, default 0644)
NOREPLACE = b"noreplace"  # commit: an existing target is kept (EEXIST for its entry)
MKDIR = b"mkdir"         # commit: missing directories are made with these bits (octal)
LEASE_OPTIONS = (TTL, RELEASE)
RELEASE_REQUEST = DIRECTIVE + RELEASE + b"\n"

LEASE_TTL = 30.0            # seconds a fast-path lease lives unless released first
LEASE_TTL_MAX = 600.0


def request(base: str, rels: list[str], ttl: float | None = None) -> bytes:
    """A control-file request: ``rels`` relative to ``base`` (relative to the mount root),
    with a lease ttl when given."""
    head = f"\0ttl {ttl}\n" if ttl else ""
    if base and base != ".":
        head += f"\0base {base}\n"
    return (head + "\n".join(rels) + "\n").encode("utf-8", "surrogateescape")


def commit_request(base: str, fd: int | None, entries: list[tuple[int, int, str]], mode: int | None = None,
                   noreplace: bool = False, dirmode: int | None = None, in_memory: list[bool] | None = None) -> bytes:
    """A ``.kvfs/commit`` request: ``entries`` of ``(offset, length, path)`` -- ``length``
    bytes at ``offset`` of the caller's descriptor ``fd`` become the file ``path`` (relative
    to ``base``, itself relative to the mount root); ``dirmode``: missing directories are made.
    ``in_memory[i]``: entry i's offset is an address in the caller's own memory instead."""
    head = ("\0noreplace\n" if noreplace else "")
    if dirmode is not None:
        head += f"\0mkdir {dirmode:o}\n"
    if mode is not None:
        head += f"\0mode {mode:o}\n"
    if base and base != ".":
        head += f"\0base {base}\n"
    lines, cur = [head], None
    for i, (off, n, path) in enumerate(entries):
        src = "\0mem\n" if in_memory is not None and in_memory[i] else f"\0fd {fd}\n"
        if src != cur:
            lines.append(src)
            cur = src
        lines.append(f"{off} {n} {path}\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


# ---- requests as the daemon reads them (a ValueError: the request fails with EINVAL) --------
COMMIT_MEMORY = "mem"       # a commit entry's source: the caller's memory (``\0mem``), not a descriptor
COMMIT_MAX_RANGES = 4096    # address ranges of one memory entry of a commit


def parse_request(raw: bytes) -> tuple[list[tuple[bytes, list[bytes]]], dict[bytes, bytes]]:
    """``([(base, paths), ...], options)`` of a ``lookup``, ``lease`` or ``get`` request
    (grammar: kvfs/fs/control.py); ValueError for an unknown directive."""
    groups: list[tuple[bytes, list[bytes]]] = []
    opts: dict[bytes, bytes] = {}
    base, paths = b"", []
    for line in raw.split(b"\n"):
        if not line:
            continue
        if line[:1] == DIRECTIVE:
            word, _, arg = line[1:].partition(b" ")
            if word == BASE:
                if paths:
                    groups.append((base, paths))
                    paths = []
                base = arg.strip(b"/")
            elif word in LEASE_OPTIONS:
                opts[word] = arg
            else:
                raise ValueError(f"unknown directive {word!r}")
            continue
        paths.append(line)
    if paths:
        groups.append((base, paths))
    return groups, opts


def parse_ttl(arg: bytes | None) -> float:
    """A lease ttl: a finite number of seconds in (0, LEASE_TTL_MAX] (LEASE_TTL when not
    given); ValueError otherwise."""
    if not arg:
        return LEASE_TTL
    ttl = float(arg)
    if not math.isfinite(ttl) or not 0 < ttl <= LEASE_TTL_MAX:
        raise ValueError(f"lease ttl out of range: {arg!r}")
    return ttl


def parse_commit_request(raw: bytes) -> tuple[list[tuple], bool, int | None]:
    """``([(fd, offset, length, path from the root, mode), ...], noreplace, dirmode)`` of a
    ``commit`` request (grammar: kvfs/fs/commitctl.py); ``fd`` is COMMIT_MEMORY for an entry
    in the caller's memory, whose offset is then ``((address, length), ...)``. ValueError if
    it does not parse."""
    out = []
    fd, base, mode, noreplace, dirmode = None, b"", 0o644, False, None
    for line in raw.split(b"\n"):
        if not line:
            continue
        if line[:1] == DIRECTIVE:
            word, _, arg = line[1:].partition(b" ")
            if word == FD:
                fd = int(arg)
            elif word == MEM:
                fd = COMMIT_MEMORY
            elif word == BASE:
                base = arg.strip(b"/")
            elif word == NOREPLACE:
                noreplace = True
            elif word == MODE:
                mode = _permission_bits(arg)
            elif word == MKDIR:
                dirmode = _permission_bits(arg)
            else:
                raise ValueError(word)
            continue
        off, n, path = line.split(b" ", 2)
        if fd is None or int(n) < 0 or not path:
            raise ValueError(line)
        full = base + b"/" + path if base and base != b"." else path
        out.append((fd, _ranges(off, int(n)) if fd == COMMIT_MEMORY else _offset(off), int(n), full, mode))
    return out, noreplace, dirmode


def _permission_bits(arg: bytes) -> int:
    bits = int(arg, 8)
    if not 0 <= bits <= 0o777:
        raise ValueError(bits)
    return bits


def _offset(tok: bytes) -> int:
    off = int(tok)
    if off < 0:
        raise ValueError(tok)
    return off


def _ranges(tok: bytes, length: int) -> tuple:
    """A memory entry's OFFSET: ``ADDR`` (``length`` bytes there) or ``ADDR+LEN,ADDR+LEN...``
    (read in order as one file; the lengths add up to ``length``)."""
    if b"+" not in tok:
        return ((_offset(tok), length),)
    out = []
    for part in tok.split(b","):
        a, _, k = part.partition(b"+")
        out.append((_offset(a), _offset(k)))
    if len(out) > COMMIT_MAX_RANGES or sum(k for _, k in out) != length:
        raise ValueError(tok)
    return tuple(out)


# ---- answers as the daemon writes them --------------------------------------------------
def encode_answer(doc) -> bytes:
    """A ``lookup``, ``lease`` release, ``commit`` or ``events`` answer: one compact JSON line."""
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def encode_stats(doc: dict) -> bytes:
    """The ``stats`` file: indented JSON with sorted keys."""
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def lookup_answer(prefix: int, tiers: list[str]) -> dict:
    """``lookup``: the first ``prefix`` paths are sealed files, ``tiers`` the top tier of each."""
    return {"prefix": prefix, "tiers": tiers}


def commit_answer(results: list[int]) -> dict:
    """``commit``: an errno per entry, in request order (0: published)."""
    return {"results": results}


def idle_event(now: float) -> dict:
    """What a read of ``events`` gets when nothing happened for a while."""
    return {"event": "idle", "time": now}


RELEASED_ANSWER = encode_answer({"released": True})     # a lease request of ``\0release``


# ---- batched get (.kvfs/get; grammar in kvfs/store/getbatch.py) ---------------------------
GET_MAX = 64 << 20                   # bytes of page data one get answer carries at most
GET_MAGIC = b"KVG1"
GET_HEAD = struct.Struct("<4sI")     # magic, entries
GET_ENTRY = struct.Struct("<iIQQ")   # errno, 0, size, xxh3_64 of the bytes


def get_data_offset(n: int) -> int:
    """Where the pages' bytes start in a get answer of ``n`` entries (after its index)."""
    size = GET_HEAD.size + GET_ENTRY.size * n
    return (size + ALIGN - 1) // ALIGN * ALIGN


def get_answer_head(n: int) -> bytearray:
    """A get answer's head and index for ``n`` entries, padded to its data (entries zero
    until ``put_get_entry``)."""
    head = bytearray(get_data_offset(n))
    GET_HEAD.pack_into(head, 0, GET_MAGIC, n)
    return head


def put_get_entry(head: bytearray, k: int, err: int, size: int, digest: int) -> None:
    """Entry ``k`` of a get answer's index: its errno, size and xxh3_64."""
    GET_ENTRY.pack_into(head, GET_HEAD.size + GET_ENTRY.size * k, err, 0, size, digest)


def decode_get_index(raw: bytes, n: int) -> list[tuple[int, int, int]]:
    """``[(errno, size, xxh3_64), ...]`` of a get answer's index; ValueError if malformed."""
    magic, count = GET_HEAD.unpack_from(raw, 0)
    if magic != GET_MAGIC or count != n or len(raw) < GET_HEAD.size + GET_ENTRY.size * n:
        raise ValueError(f"bad get answer head {bytes(raw[:16])!r}")
    out = []
    for i in range(n):
        err, _, size, digest = GET_ENTRY.unpack_from(raw, GET_HEAD.size + GET_ENTRY.size * i)
        out.append((err, size, digest))
    return out


# ---- lease entries -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Backing:
    tier: str
    path: str
    offset: int
    size: int
    checksum: str
    direct: bool


def valid_backing(b: Backing) -> bool:
    return b.offset >= 0 and b.size > 0 and len(b.checksum) == 16


def encode_lease_entry(b: dict | None) -> str:
    """A lease entry as JSON text from a backing dict (``Owners.backing_of``), or ``null``."""
    if b is None:
        return "null"
    return json.dumps([b["tier"], b["path"], b["offset"], b["size"], b["checksum"], bool(b.get("direct"))],
                      separators=(",", ":"))


def encode_lease_answer(answer: dict, entries: list[str]) -> bytes:
    """A lease answer: ``answer`` (``lookup_answer``'s fields, then ``lease`` and ``ttl``) with
    ``blocks``, the lease entries already encoded (``encode_lease_entry``). ``prefix`` comes
    first: ``lease_answer_prefix`` reads it back without parsing the blocks."""
    head = json.dumps({"prefix": answer["prefix"], **answer}, separators=(",", ":"))
    return (head[:-1] + ',"blocks":[' + ",".join(entries) + "]}\n").encode()


def lease_answer_prefix(answer: bytes) -> int:
    """The ``prefix`` of an answer ``encode_lease_answer`` wrote (its first field)."""
    return int(answer.split(b",", 1)[0][len(b'{"prefix":'):])


def decode_lease_entry(entry) -> Backing | None:
    """A lease answer's ``[tier, path, offset, size, checksum, direct]`` (or null)."""
    if entry is None:
        return None
    try:
        tier, path, offset, size, checksum, direct = entry
        b = Backing(str(tier), str(path), int(offset), int(size), str(checksum).lower(), bool(direct))
    except (ValueError, TypeError) as e:
        log.warning("unusable lease entry %r: %s", entry, e)
        return None
    return b if valid_backing(b) else None


def decode_backing_xattr(raw: bytes) -> Backing | None:
    """The ``user.kvfs.backing`` value (a JSON object), or None if it is unusable."""
    try:
        d = json.loads(raw)
        b = Backing(str(d["tier"]), str(d["path"]), int(d["offset"]), int(d["size"]),
                    str(d["checksum"]).lower(), bool(d.get("direct", False)))
    except (ValueError, KeyError, TypeError) as e:
        log.warning("unusable %s value %r: %s", BACKING_XATTR, raw[:200], e)
        return None
    if not valid_backing(b):
        log.warning("unusable %s value %r", BACKING_XATTR, raw[:200])
        return None
    return b


# ---- the name table (kvfs.store.names writes it, kvfs.kv.names reads it) ------------------
# A shared-memory file: a header of NAMES_HEADER little-endian uint64 words, then a power-of-two
# number of uint64 slots (open addressing, linear probing). A slot holds names_hash() of one
# directory entry, NAMES_EMPTY or NAMES_TOMB. ``.kvfs/stats`` names the file and the run id.
NAMES_MAGIC = 0x31454d414e53464b      # b"KFSNAME1" read as a little-endian uint64
# Version 2 gives meaning to word 6, which version 1 left 0 (the slots are unchanged; a reader
# still reads a version-1 table, without caching directory inodes): H_DIRS counts removals of
# directory entries that were not regular files (rmdir, a directory renamed away or over, a
# symlink removed). A reader may use a directory's inode (path -> inode) with no system call
# while this word has the value it read before the ``stat`` that gave the inode.
NAMES_VERSION = 2
NAMES_VERSIONS = (1, 2)                # what readers accept
NAMES_HEADER = 8                       # words: magic, version, capacity, generation, run, live, dirs, 0
H_MAGIC, H_VERSION, H_CAPACITY, H_GENERATION, H_RUN, H_LIVE, H_DIRS = range(7)
NAMES_EMPTY, NAMES_TOMB = 0, 1
NAMES_STALE = 0                        # generation of a table that was replaced (readers remap)
NAMES_STATS_KEY = "names"              # .kvfs/stats: {"path": ..., "run": ...} or null
NAMES_BUILDING_KEY = "names_building"  # .kvfs/stats: true while the daemon builds it (names: null)


def names_hash(parent_ino: int, name: bytes) -> int:
    """The slot value of the entry ``name`` in directory ``parent_ino`` (never EMPTY/TOMB)."""
    return names_hash_key(parent_ino.to_bytes(8, "big") + name)


def names_hash_key(key: bytes) -> int:
    """``names_hash`` of the entry whose key is ``key``: the parent inode (8 bytes, big endian)
    followed by the name, as the index keys directory entries."""
    h = xxhash.xxh3_64_intdigest(key)
    return h if h > NAMES_TOMB else h + 2
