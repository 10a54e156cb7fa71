"""The reserved ``.kvfs`` directory: read-only stats and the one-call prefix lookup."""
from __future__ import annotations

import errno
import json
import stat
import time

import pyfuse3

CTRL_DIR = 0xFFFF_FFFF_FFFF_0000
STATS = CTRL_DIR + 1
LOOKUP = CTRL_DIR + 2
FILES = {b"stats": STATS, b"lookup": LOOKUP}
CONTROL_NAME_B = b".kvfs"
_MAX_REQUEST = 16 << 20


def is_control(ino: int) -> bool:
    return ino >= CTRL_DIR


def attrs(ino: int) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    now = time.time_ns()
    a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = now
    a.entry_timeout = a.attr_timeout = 60
    if ino == CTRL_DIR:
        a.st_mode, a.st_nlink = stat.S_IFDIR | 0o555, 2
    elif ino == STATS:
        a.st_mode, a.st_nlink = stat.S_IFREG | 0o444, 1
    else:
        a.st_mode, a.st_nlink = stat.S_IFREG | 0o666, 1
    a.st_size = 0
    a.st_blksize = 4096
    return a


class ControlHandle:
    """Per-open state of a control file: a snapshot (stats) or a request/answer (lookup)."""

    def __init__(self, ino: int):
        self.ino = ino
        self.request = bytearray()
        self.answer: bytes | None = None


class Control:
    def __init__(self, cache, describe):
        self.cache = cache
        self.describe = describe      # () -> dict of mount facts (pid, mountpoint, ...)

    def lookup(self, name: bytes) -> pyfuse3.EntryAttributes:
        if name not in FILES:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return attrs(FILES[name])

    def stats_json(self) -> bytes:
        doc = dict(self.describe())
        doc.update(self.cache.statistics())
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()

    def open(self, ino: int, flags: int) -> ControlHandle:
        if ino == CTRL_DIR:
            raise pyfuse3.FUSEError(errno.EISDIR)
        h = ControlHandle(ino)
        if ino == STATS:
            if flags & 3:
                raise pyfuse3.FUSEError(errno.EACCES)
            h.answer = self.stats_json()
        return h

    def read(self, h: ControlHandle, off: int, size: int) -> bytes:
        if h.ino == LOOKUP and h.answer is None:
            paths = [p for p in h.request.decode("utf-8", "surrogateescape").split("\n") if p]
            h.answer = (json.dumps(self.cache.lookup_paths(paths)) + "\n").encode()
            h.request = bytearray()
        return (h.answer or b"")[off:off + size]

    def write(self, h: ControlHandle, off: int, buf: bytes) -> int:
        if h.ino != LOOKUP:
            raise pyfuse3.FUSEError(errno.EACCES)
        if h.answer is not None:           # a new request after an answer
            h.answer = None
            h.request = bytearray()
        if len(h.request) + len(buf) > _MAX_REQUEST:
            raise pyfuse3.FUSEError(errno.E2BIG)
        h.request += buf
        return len(buf)

    def readdir(self, start_id: int, token) -> None:
        names = sorted(FILES.items())
        for i, (name, ino) in enumerate(names[start_id:], start=start_id + 1):
            if not pyfuse3.readdir_reply(token, name, attrs(ino), i):
                return
