"""The reserved ``.kvfs`` directory: read-only stats, the one-call prefix lookup and leases,
KV events, the batched ``commit`` of files (its grammar: kvfs/fs/commitctl.py) and the
batched ``get`` of small files' bytes (its answer: kvfs/store/getbatch.py; its request is
the ``lookup`` grammar below).

``lookup`` and ``lease`` take a request written at offset 0 (a larger request may arrive as
several writes at increasing offsets) and answer it on the next read:

    request   := (line "\\n")*        empty lines are ignored
    line      := path | directive     a path is relative to the current base
    directive := "\\0" word [" " argument]      (NUL never occurs in a path)

Directives: ``\\0base DIR`` (later paths are relative to DIR, itself relative to the mount
root; default the root), ``\\0ttl SECONDS`` (lease only, default 30, at most 600) and
``\\0release`` (lease only: release this descriptor's lease, grant nothing). A ttl that is
not a finite number in (0, 600] is refused with EINVAL. kvfs.protocol parses requests and
encodes answers (for every control file); this module serves them.

Both answer as the caller: the uid, gid and groups of the process that opened the control
file. A path the caller could not open for reading through the mount (search permission
on every directory, read permission on the file) ends the prefix like a missing one, so
neither file answers anything about it; non-root leases are bounded (see Leases.grant).

``lookup`` answers ``{"prefix": k, "tiers": [...]}``: the first ``k`` paths are sealed
regular files (the first that is not ends the prefix), with the highest tier of each.
``lease`` answers the same plus ``"lease"`` (id), ``"ttl"`` and ``"blocks"``: per leased file
``[tier, path, offset, size, xxh3_64 hex, direct]`` (its backing location) or ``null`` (no
fast path: read it through the mount). The leased objects stay where they are, counted as
open, until the next request on the same descriptor, its close, or the ttl.

``events`` streams KV events (kvfs.events) as JSON lines from the moment it is opened; a read
waits until there is one, at most EVENT_WAIT seconds, then answers ``{"event": "idle"}``. Only root and the daemon's user may open it (event paths name every
tenant's files), and at most EVENT_READERS descriptors at once (each waiting read holds one of
the FUSE session's worker tasks): EBUSY past that.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

import pyfuse3
import trio

from kvfs import protocol
from kvfs.fs import dirreply
from kvfs.fs.commitctl import CommitControl
from kvfs.store.store import ROOT, Cred

log = logging.getLogger(__name__)

CTRL_DIR = 0xFFFF_FFFF_FFFF_0000
STATS = CTRL_DIR + 1
LOOKUP = CTRL_DIR + 2
LEASE = CTRL_DIR + 3
EVENTS = CTRL_DIR + 4
COMMIT = CTRL_DIR + 5
GET = CTRL_DIR + 6
FILES = {protocol.STATS_FILE.encode(): STATS, protocol.LOOKUP_FILE.encode(): LOOKUP,
         protocol.LEASE_FILE.encode(): LEASE, protocol.EVENTS_FILE.encode(): EVENTS,
         protocol.COMMIT_FILE.encode(): COMMIT, protocol.GET_FILE.encode(): GET}
REQUESTS = (LOOKUP, LEASE, COMMIT, GET)     # control files that take a request and answer it
EVENT_READERS = 8
EVENT_WAIT = 1.0        # seconds a read of .kvfs/events waits before it answers an idle line


def idle_line(size: int) -> bytes:
    """What a read of ``.kvfs/events`` gets when nothing happened for EVENT_WAIT seconds."""
    return protocol.encode_answer(protocol.idle_event(time.time()))[:size]
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
    elif ino == EVENTS:
        a.st_mode, a.st_nlink = stat.S_IFREG | 0o400, 1
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
    else:
        a.st_mode, a.st_nlink = stat.S_IFREG | 0o666, 1
    a.st_size = 0
    a.st_blksize = protocol.ALIGN
    return a


class ControlHandle:
    """Per-open state of a control file: a snapshot (stats) or a request/answer."""

    def __init__(self, ino: int, cred: Cred = ROOT):
        self.ino = ino
        self.cred = cred                   # who opened it: answers are for this caller
        self.request = bytearray()
        self.answer: bytes | None = None
        self.lease: int | None = None      # the lease this descriptor holds (lease file)
        self.events = None                 # its kvfs.events.Subscriber (events file)
        self.process = None                # who opened it (commit file: kvfs.store.caller.CallerProcess)


def caller(ctx) -> Cred:
    """The credentials of a FUSE request: uid and gid from the request, supplementary groups
    from /proc (the kernel does not send them; a process that is gone has none)."""
    if ctx is None:
        return ROOT
    groups: frozenset = frozenset()
    if ctx.uid != 0:
        try:
            with open(f"/proc/{ctx.pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        groups = frozenset(int(g) for g in line.split()[1:])
                        break
        except (OSError, ValueError):
            pass
    return Cred(ctx.uid, ctx.gid, groups)


def parse_request(raw: bytes) -> tuple[list[tuple[bytes, list[bytes]]], dict[bytes, bytes]]:
    """``([(base, paths), ...], options)`` of a request (kvfs.protocol.parse_request); EINVAL
    if it does not parse."""
    try:
        return protocol.parse_request(raw)
    except ValueError:
        raise pyfuse3.FUSEError(errno.EINVAL) from None


def parse_ttl(arg: bytes | None) -> float:
    """A lease ttl (kvfs.protocol.parse_ttl); EINVAL if it is not one."""
    try:
        return protocol.parse_ttl(arg)
    except ValueError:
        raise pyfuse3.FUSEError(errno.EINVAL) from None


class Control:
    shared = None          # kvfs.remote.share.adopt.SharedNames on a shared remote volume

    def __init__(self, store, describe):
        self.store = store
        self.describe = describe      # () -> dict of mount facts (pid, mountpoint, ...)
        self.telemetry = store.telemetry
        self.commits = CommitControl(store, describe)

    def lookup(self, name: bytes) -> pyfuse3.EntryAttributes:
        if name not in FILES:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return attrs(FILES[name])

    def stats_json(self) -> bytes:
        doc = dict(self.describe())
        doc.update(self.store.statistics())
        tel = self.telemetry.snapshot()
        for key in ("namespaces", "admission_dropped", "deadline_exceeded", "events"):
            doc[key] = tel[key]
        doc["uptime"] = time.time() - self.telemetry.started
        quotas = getattr(self.store, "quotas", None)
        if quotas is not None:
            doc["quotas"] = quotas.statistics()
        return protocol.encode_stats(doc)

    def open(self, ino: int, flags: int, cred: Cred = ROOT, pid: int = 0) -> ControlHandle:
        if ino == CTRL_DIR:
            raise pyfuse3.FUSEError(errno.EISDIR)
        h = ControlHandle(ino, cred)
        if ino == STATS:
            if flags & 3:
                raise pyfuse3.FUSEError(errno.EACCES)
            h.answer = self.stats_json()
        elif ino == EVENTS:
            hub = self.telemetry.events
            if flags & 3:
                raise pyfuse3.FUSEError(errno.EACCES)
            if cred.uid not in (0, os.getuid()):
                raise pyfuse3.FUSEError(errno.EACCES)
            if len(hub.subscribers) >= EVENT_READERS:
                raise pyfuse3.FUSEError(errno.EBUSY)
            h.events = hub.subscribe()
        elif ino == COMMIT:
            h.process = self.commits.caller_process(pid)
        return h

    def _lookup_answer(self, groups, cred: Cred) -> dict:
        objs = []
        for base, paths in groups:
            got = self.store.leases.prefix_objects(paths, base, cred)
            objs += got
            if len(got) < len(paths):
                self._misses(base, paths[len(got):])
                break
        return self.store.leases.prefix_answer(objs)

    def _misses(self, base: bytes, paths: list[bytes]) -> None:
        """Count the paths past a prefix's end as misses of their namespaces."""
        for p in paths:
            full = (base + b"/" + p) if base else p
            self.telemetry.miss(full.decode("utf-8", "surrogateescape"))

    async def read(self, h: ControlHandle, off: int, size: int) -> bytes:
        if h.events is not None:
            # never wait long: once a FUSE request is in the daemon's hands the kernel waits
            # for its answer even if the reader is killed (pyfuse3 ignores interrupts)
            with trio.move_on_after(EVENT_WAIT):
                while not h.events.ready() and not h.events.closed:
                    await h.events.wakeup.wait()
            if not h.events.ready():
                return b"" if h.events.closed else idle_line(size)
            return h.events.take(size)
        if h.answer is None and h.ino == COMMIT:
            raw, h.request = bytes(h.request), bytearray()
            h.answer = protocol.encode_answer(await self.commits.serve(h, raw))
        if h.answer is None and h.ino == GET:
            raw, h.request = bytes(h.request), bytearray()
            groups, opts = parse_request(raw)
            if opts:
                raise pyfuse3.FUSEError(errno.EINVAL)
            if self.shared is not None:           # names other nodes published, not yet local
                await self.shared.adopt_paths(groups)
            h.answer = await self.store.gets.answer(groups, h.cred)
        if h.answer is None and h.ino in (LOOKUP, LEASE):
            raw, h.request = bytes(h.request), bytearray()
            groups, opts = parse_request(raw)
            if h.ino == LOOKUP:
                if self.shared is not None:       # names other nodes published, not yet local
                    await self.shared.adopt_paths(groups)
                h.answer = protocol.encode_answer(self._lookup_answer(groups, h.cred))
            else:
                await self.release(h)
                if protocol.RELEASE in opts:
                    h.answer = protocol.RELEASED_ANSWER
                else:
                    ttl = parse_ttl(opts.get(protocol.TTL))
                    if len(groups) > 1:
                        raise pyfuse3.FUSEError(errno.EINVAL)     # one base per lease
                    base, paths = groups[0] if groups else (b"", [])
                    t0 = time.perf_counter()
                    h.lease, h.answer = self.store.leases.grant(paths, base, ttl, h.cred)
                    self.telemetry.latency["lease"].observe(time.perf_counter() - t0)
                    prefix = protocol.lease_answer_prefix(h.answer)
                    self._misses(base, paths[prefix:])
        return (h.answer or b"")[off:off + size]

    async def write(self, h: ControlHandle, off: int, buf: bytes) -> int:
        if h.ino not in REQUESTS:
            raise pyfuse3.FUSEError(errno.EACCES)
        if h.answer is not None or off == 0:    # a new request: drop the last answer and lease
            h.answer = None
            h.request = bytearray()
            await self.release(h)
        if len(h.request) + len(buf) > _MAX_REQUEST:
            raise pyfuse3.FUSEError(errno.E2BIG)
        h.request += buf
        return len(buf)

    async def release(self, h: ControlHandle) -> None:
        """Drop the lease this descriptor holds (a new request, close, or ``\\0release``)."""
        if h.events is not None and h.ino == EVENTS:
            self.telemetry.events.unsubscribe(h.events)
        if h.lease is not None:
            lid, h.lease = h.lease, None
            await self.store.leases.release(lid)

    async def close(self, h: ControlHandle) -> None:
        """The descriptor was closed: its lease ends, its commit process handle goes."""
        await self.release(h)
        if h.process is not None:
            h.process.close()
            h.process = None

    def readdir(self, start_id: int, token) -> None:
        names = sorted(FILES.items())
        for i, (name, ino) in enumerate(names[start_id:], start=start_id + 1):
            if not dirreply.reply(token, name, attrs(ino), i):
                return
