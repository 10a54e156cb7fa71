"""The files of the index kept beside LMDB's: the header (``index.hdr``: magic, format,
instance, checksum) and a sanity check of the LMDB data file before it is mapped
(kvfs.store.index opens the index with both); and the opening of the environment."""
from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import lmdb
import xxhash

from kvfs.errors import ConfigError, IndexDamaged
from kvfs.store import records
from kvfs.store.records import FORMAT_VERSION, FSCK_HINT
from kvfs.store.safedir import read_file

HEADER_NAME = "index.hdr"


def open_env(env_dir: Path, map_size: int, state_dir: Path) -> "lmdb.Environment":
    """The LMDB environment in ``env_dir``, private to the daemon's user."""
    try:
        os.mkdir(env_dir, 0o700)
    except FileExistsError:
        pass
    back_lock_file(env_dir / "lock.mdb", create=True)     # before LMDB maps it (see there)
    try:
        # sync=False: commits survive kill -9 (the page cache keeps them); sync() is
        # called periodically and at unmount for power-loss durability.
        env = lmdb.open(str(env_dir), map_size=map_size, max_dbs=8, subdir=True, sync=False,
                        metasync=False, readahead=False, lock=True, mode=0o600)
    except lmdb.Error as e:
        raise IndexDamaged(f"LMDB cannot open the index in {state_dir}: {e}; {FSCK_HINT}") from None
    for name in ("data.mdb", "lock.mdb"):
        try:
            os.chmod(env_dir / name, 0o600)
        except OSError:
            pass
    os.chmod(env_dir, 0o700)
    try:
        back_lock_file(env_dir / "lock.mdb")
    except BaseException:
        env.close()
        raise
    return env


LOCK_FILE_MIN = 64 << 10    # lock.mdb made this big before LMDB opens it (~1000 reader slots)


def back_lock_file(path: Path, create: bool = False) -> None:
    """Give every block of LMDB's ``lock.mdb`` its disk space now. LMDB makes it with
    ``ftruncate`` (a sparse file) and writes its reader table through a shared writable
    mapping: on a full state filesystem, the first write to a page without a block is a
    SIGBUS that kills the opening process (the daemon, fsck). ``fallocate`` answers ENOSPC
    instead: refused in one line. ``create``: before LMDB opens it, make it LOCK_FILE_MIN
    bytes (LMDB keeps a lock file larger than it needs, as more reader slots)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return
    size = 0
    try:
        size = max(os.fstat(fd).st_size, LOCK_FILE_MIN if create else 0)
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ConfigError(f"the state filesystem of {path.parent} is full: no room for LMDB's lock "
                              f"file ({size} bytes); free space there and mount again") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    finally:
        os.close(fd)


def check_lmdb_file(path: Path) -> None:
    """Refuse a ``data.mdb`` shorter than its newest meta page says (LMDB maps the file:
    touching a page past its end is a SIGBUS, not an error)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    with open(path, "rb") as f:
        head = f.read(16 + 200)
        if len(head) < 152:
            raise IndexDamaged(f"{path} is truncated ({size} bytes); {FSCK_HINT}")
        psize = struct.unpack_from("<I", head, 40)[0]       # mm_dbs[FREE].md_pad = page size
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            raise IndexDamaged(f"{path} has no valid LMDB meta page; {FSCK_HINT}")
        f.seek(psize)
        second = f.read(152)
    best = None
    for page in (head, second):
        if len(page) < 152 or struct.unpack_from("<I", page, 16)[0] != 0xBEEFC0DE:
            continue
        last_pg, txnid = struct.unpack_from("<QQ", page, 136)
        if best is None or txnid > best[1]:
            best = (last_pg, txnid)
    if best is None:
        raise IndexDamaged(f"{path} has no valid LMDB meta page; {FSCK_HINT}")
    need = (best[0] + 1) * psize
    if size < need:
        raise IndexDamaged(f"{path} is truncated ({size} of at least {need} bytes); {FSCK_HINT}")


def _header_sum(version: int, instance: str) -> str:
    return xxhash.xxh3_64_hexdigest(f"kvfs-index {version} {instance}".encode())


def make_header(instance: str) -> dict:
    return {"magic": "kvfs-index", "version": FORMAT_VERSION, "instance": instance,
            "sum": _header_sum(FORMAT_VERSION, instance)}


def check_header(doc: dict, where: str) -> str:
    """The instance id of a valid header ``doc``; IndexDamaged otherwise."""
    if doc.get("magic") != "kvfs-index":
        raise IndexDamaged(f"{where}: not a kvfs index header; {FSCK_HINT}")
    version, instance = doc.get("version"), doc.get("instance")
    if version != FORMAT_VERSION:
        raise IndexDamaged(f"{where}: index format {version!r} is not the supported format "
                           f"{FORMAT_VERSION}; {FSCK_HINT}")
    if not isinstance(instance, str) or doc.get("sum") != _header_sum(version, instance):
        raise IndexDamaged(f"{where}: header checksum mismatch; {FSCK_HINT}")
    return instance


def read_header(state_fd: int, state_dir) -> dict | None:
    raw = read_file(state_fd, HEADER_NAME)
    if raw is None:
        return None
    try:
        return records.decode_meta(raw)
    except IndexDamaged:
        raise IndexDamaged(f"{state_dir}/{HEADER_NAME} does not parse; {FSCK_HINT}") from None
