"""The FUSE kernel protocol: opcodes, flags and the structures kvfs's own transport reads and
writes (kvfs/fs/session.py). Written from ``include/uapi/linux/fuse.h`` (Linux 6.18, protocol
7.45); only what kvfs answers is here. Every structure is little-endian and packed as the
kernel's C structs (explicit padding fields included).
"""
from __future__ import annotations

import struct

MAJOR = 7
MIN_MINOR = 36          # FUSE_INIT_EXT (flags2): older kernels get the pyfuse3 transport
MAX_MINOR = 45          # the newest layout written here

# ---- opcodes ---------------------------------------------------------------------------------
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE, STATFS = 8, 9, 10, 11, 12, 13, 14, 15, 16, 17
RELEASE, FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = 18, 20, 21, 22, 23, 24, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, ACCESS, CREATE, INTERRUPT = 27, 28, 29, 30, 34, 35, 36
DESTROY, BATCH_FORGET, READDIRPLUS, RENAME2 = 38, 42, 44, 45
NO_REPLY = frozenset((FORGET, BATCH_FORGET, INTERRUPT))
NAMES = {v: k.lower() for k, v in dict(
    LOOKUP=LOOKUP, FORGET=FORGET, GETATTR=GETATTR, SETATTR=SETATTR, READLINK=READLINK,
    SYMLINK=SYMLINK, MKNOD=MKNOD, MKDIR=MKDIR, UNLINK=UNLINK, RMDIR=RMDIR, RENAME=RENAME, LINK=LINK,
    OPEN=OPEN, READ=READ, WRITE=WRITE, STATFS=STATFS, RELEASE=RELEASE, FSYNC=FSYNC,
    SETXATTR=SETXATTR, GETXATTR=GETXATTR, LISTXATTR=LISTXATTR, REMOVEXATTR=REMOVEXATTR,
    FLUSH=FLUSH, INIT=INIT, OPENDIR=OPENDIR, READDIR=READDIR, RELEASEDIR=RELEASEDIR,
    FSYNCDIR=FSYNCDIR, ACCESS=ACCESS, CREATE=CREATE, INTERRUPT=INTERRUPT, DESTROY=DESTROY,
    BATCH_FORGET=BATCH_FORGET, READDIRPLUS=READDIRPLUS, RENAME2=RENAME2).items()}

# ---- INIT flags (flags2 are bits 32..63) --------------------------------------------------------
ASYNC_READ, ATOMIC_O_TRUNC, BIG_WRITES = 1 << 0, 1 << 3, 1 << 5
AUTO_INVAL_DATA, DO_READDIRPLUS, ASYNC_DIO, WRITEBACK_CACHE = 1 << 12, 1 << 13, 1 << 15, 1 << 16
PARALLEL_DIROPS, HANDLE_KILLPRIV, MAX_PAGES = 1 << 18, 1 << 19, 1 << 22
INIT_EXT = 1 << 30
HANDLE_KILLPRIV_V2 = 1 << 28
PASSTHROUGH, OVER_IO_URING = 1 << 37, 1 << 41
# what pyfuse3 3.5 over libfuse 3.14 asks for (its defaults for kvfs's handlers), so that both
# transports give the kernel the same contract, except that setuid/setgid are killed by the
# kernel's word (HANDLE_KILLPRIV_V2, kvfs/fs/killpriv.py) rather than libfuse's HANDLE_KILLPRIV,
# which leaves the daemon to guess; passthrough is added by the session
BASE_WANT = (ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | AUTO_INVAL_DATA | DO_READDIRPLUS | ASYNC_DIO
             | PARALLEL_DIROPS | HANDLE_KILLPRIV_V2 | MAX_PAGES | INIT_EXT)

# ---- OPEN reply flags -----------------------------------------------------------------------
FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_NONSEEKABLE = 1 << 0, 1 << 1, 1 << 2
FOPEN_NOFLUSH, FOPEN_PASSTHROUGH = 1 << 5, 1 << 7

# ---- SETATTR valid bits ---------------------------------------------------------------------
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1, 2, 4, 8
FATTR_ATIME, FATTR_MTIME, FATTR_FH, FATTR_ATIME_NOW, FATTR_MTIME_NOW = 16, 32, 64, 128, 256
FATTR_KILL_SUIDGID = 1 << 11

# ---- setuid/setgid kills the kernel asks for (HANDLE_KILLPRIV_V2) ---------------------------
WRITE_KILL_SUIDGID = 1 << 2        # fuse_write_in.write_flags
OPEN_KILL_SUIDGID = 1 << 0         # fuse_open_in.open_flags

# ---- structures -----------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")       # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")            # len error unique
INIT_IN = struct.Struct("<IIIII")             # major minor max_readahead flags flags2 (+ unused)
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")  # ... max_pages map_alignment flags2 stack_depth timeout
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")     # fuse_attr (88 bytes)
ENTRY_OUT = struct.Struct("<QQQQII")          # nodeid generation entry_valid attr_valid (+ nsec)
ATTR_OUT = struct.Struct("<QII")              # attr_valid attr_valid_nsec dummy
# the same followed by fuse_attr, packed in one call (LOOKUP, GETATTR, CREATE answers)
ENTRY_ATTR = struct.Struct(ENTRY_OUT.format + ATTR.format[1:])
ATTR_OUT_ATTR = struct.Struct(ATTR_OUT.format + ATTR.format[1:])
GETATTR_IN = struct.Struct("<IIQ")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # valid pad fh size lock atime mtime ctime ...
MKNOD_IN = struct.Struct("<IIII")             # mode rdev umask pad
MKDIR_IN = struct.Struct("<II")               # mode umask
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")            # newdir flags pad
LINK_IN = struct.Struct("<Q")
OPEN_IN = struct.Struct("<II")                # flags open_flags
CREATE_IN = struct.Struct("<IIII")            # flags mode umask open_flags
OPEN_OUT = struct.Struct("<QIi")              # fh open_flags backing_id
RELEASE_IN = struct.Struct("<QIIQ")           # fh flags release_flags lock_owner
FLUSH_IN = struct.Struct("<QIIQ")
READ_IN = struct.Struct("<QQIIQII")           # fh offset size read_flags lock_owner flags pad
WRITE_IN = READ_IN
WRITE_OUT = struct.Struct("<II")
FSYNC_IN = struct.Struct("<QII")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")   # blocks bfree bavail files ffree bsize namelen frsize
SETXATTR_IN = struct.Struct("<II")            # size flags (FUSE_SETXATTR_EXT is not asked for)
GETXATTR_IN = struct.Struct("<II")
GETXATTR_OUT = struct.Struct("<II")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
DIRENT = struct.Struct("<QQII")               # ino off namelen type
BACKING_MAP = struct.Struct("<iIQ")           # fd flags padding


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (229 << 8) | nr


DEV_IOC_BACKING_OPEN = _iow(1, BACKING_MAP.size)
DEV_IOC_BACKING_CLOSE = _iow(2, 4)


_SPLIT: dict = {}        # timeouts already split (the handlers use a few constants)


def split_time(seconds: float) -> tuple[int, int]:
    """A timeout in seconds as the kernel's (seconds, nanoseconds)."""
    hit = _SPLIT.get(seconds)
    if hit is not None:
        return hit
    if seconds <= 0:
        out = (0, 0)
    else:
        whole = int(seconds)
        out = (whole, int((seconds - whole) * 1e9))
    if len(_SPLIT) < 64:
        _SPLIT[seconds] = out
    return out


def _attr_fields(a) -> tuple:
    at, mt, ct = a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns
    return (a.st_ino, a.st_size, a.st_blocks, at // 1_000_000_000, mt // 1_000_000_000,
            ct // 1_000_000_000, at % 1_000_000_000, mt % 1_000_000_000, ct % 1_000_000_000,
            a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_rdev, a.st_blksize, 0)


def attr_bytes(a) -> bytes:
    """``fuse_attr`` of an attributes object (pyfuse3.EntryAttributes' field names)."""
    return ATTR.pack(*_attr_fields(a))


_NEGATIVE_ATTR = bytes(ATTR.size)


def entry_bytes(a) -> bytes:
    """``fuse_entry_out`` (a negative entry when ``st_ino`` is 0: only its timeout counts)."""
    es, ens = split_time(a.entry_timeout)
    if not a.st_ino:
        return ENTRY_OUT.pack(0, 0, es, 0, ens, 0) + _NEGATIVE_ATTR
    as_, ans = split_time(a.attr_timeout)
    return ENTRY_ATTR.pack(a.st_ino, a.generation, es, as_, ens, ans, *_attr_fields(a))


def attr_out_bytes(a) -> bytes:
    as_, ans = split_time(a.attr_timeout)
    return ATTR_OUT_ATTR.pack(as_, ans, 0, *_attr_fields(a))


def dirent_bytes(name: bytes, ino: int, next_off: int, mode: int, plus_entry: bytes | None) -> bytes:
    """One ``fuse_dirent`` (``fuse_direntplus`` with the entry), padded to 8 bytes."""
    rec = DIRENT.pack(ino, next_off, len(name), (mode >> 12) & 0xF) + name
    rec += b"\0" * (-len(rec) % 8)
    return plus_entry + rec if plus_entry is not None else rec


def names_in(body, count: int) -> list[bytes]:
    """``count`` NUL-terminated names at the start of a request body (ValueError when the
    body holds fewer)."""
    out = bytes(body).split(b"\0", count)
    if len(out) <= count:
        raise ValueError(f"{count} names expected in the request")
    del out[count]
    return out
