"""Leased pages read beside FUSE, for :class:`kvfs.integrations.pages.PageStore`.

A leased page on the NVMe tier whose destination is one page-aligned range is read with
O_DIRECT straight into it (no staging copy). Its checksum is then computed over memory the
disk has just written, which is not in the CPU cache: about a tenth of the read's time on the
machines measured (docs/benchmarks.md, "NVMe get"). :class:`Ahead` hides that: while the
caller hashes page *i*, one helper thread reads page *i+1*. The disk still sees one read at a
time (never more than one read ahead per caller), so the adapter's rate is comparable with a
single-threaded raw O_DIRECT reader; the reads simply follow each other without a gap.

A page is only a hit once its own checksum matched; a page read ahead and never verified (the
batch ended first) is not reported, and the caller waits for every read it started before it
returns (nothing writes into a runtime's buffer after the call).
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import threading

import xxhash

from kvfs.kv.block import ChecksumMismatch
from kvfs.kv.blockio import PAGE, AlignedBuffer, Backing, mismatch, page_aligned, read_backing, read_backing_into
from kvfs.integrations.pagetypes import PIECE, cuts as _cuts
from kvfs.kv.mapcheck import maps_fuse_file

log = logging.getLogger(__name__)

_NO_HEAD = memoryview(bytearray(0))   # raw pages have no header
_POOL_WORKERS = 8                     # helper threads shared by every caller of the process
_pool: cf.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _helpers() -> cf.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = cf.ThreadPoolExecutor(_POOL_WORKERS, thread_name_prefix="kvfs-read-ahead")
        return _pool


def in_place(b: Backing | None, segs: list[memoryview], size: int) -> bool:
    """Whether leased page ``b`` can be read with O_DIRECT straight into its destination."""
    return (b is not None and b.direct and b.size == size and b.offset % PAGE == 0 and len(segs) == 1
            and size % PAGE == 0 and page_aligned(segs[0]) and not maps_fuse_file(segs[0]))


def ahead_of(j: int, backs, dests: list[list[memoryview]], sizes: list[int], batched) -> tuple | None:
    """``(j, backing, destination)`` when page ``j`` (leased as ``backs[j]``) can be read ahead
    of its turn (``in_place``; not among the ``batched`` pages), else None."""
    if j >= len(dests) or j >= len(backs) or j in batched:
        return None
    return (j, backs[j], dests[j][0]) if in_place(backs[j], dests[j], sizes[j]) else None


class Ahead:
    """At most one page read running in a helper thread ahead of the caller (one per call;
    not shared between threads). ``close`` waits for it."""

    def __init__(self):
        self._pending: dict[int, cf.Future] = {}

    def start(self, i: int, b: Backing, mv: memoryview) -> None:
        self._pending[i] = _helpers().submit(read_backing, b, mv, check=False)

    def take(self, i: int) -> cf.Future | None:
        return self._pending.pop(i, None)

    def close(self) -> None:
        pending, self._pending = list(self._pending.values()), {}
        cf.wait(pending)


def read_leased(b: Backing, name: str, segs: list[memoryview], size: int, *, local: threading.local,
                verified=None, ahead: Ahead | None = None, i: int = -1,
                nxt: tuple[int, Backing, memoryview] | None = None) -> int | None:
    """Read leased page ``name`` beside FUSE into ``segs`` and verify it; None: the fast path
    failed (e.g. demoted meanwhile; the lease makes this rare), read it through the mount.
    ``ahead``/``i``/``nxt``: page ``i`` may already be under way in ``ahead``; ``nxt`` (index,
    backing, destination) is the next page to start before this one is hashed."""
    try:
        if in_place(b, segs, size):
            fut = ahead.take(i) if ahead is not None else None
            try:
                n = fut.result() if fut is not None else read_backing(b, segs[0], check=False)
            finally:
                if ahead is not None and nxt is not None:
                    ahead.start(*nxt)
            got = xxhash.xxh3_64_hexdigest(segs[0][:b.size])
            if got != b.checksum:
                raise mismatch(b, got)
            return n
        if b.direct:        # O_DIRECT: whole pages into an aligned buffer, then copied out
            return _copy_hashing(b, segs, _staging(local, size))
        verified = verified if b.tier == "ram" else None
        return read_backing_into(b, _NO_HEAD, segs, _cuts(segs), verified=verified)
    except ChecksumMismatch:
        raise
    except OSError as e:
        log.debug("%s: fast path failed (%s); reading through the mount", name, e)
        return None


def _copy_hashing(b: Backing, segs: list[memoryview], buf: AlignedBuffer) -> int:
    """Read ``b`` with O_DIRECT into ``buf``, copy it out into ``segs`` a piece at a time and
    hash each piece of the destination right after its copy, while it is in the CPU cache:
    one pass over the bytes the disk wrote instead of a hash pass and a copy pass. The
    checksum covers exactly the bytes the caller gets; a mismatch raises (``segs`` then hold
    unverified bytes and are not reported as a hit)."""
    read_backing(b, buf.mv, check=False)
    h = xxhash.xxh3_64()
    for s, off in zip(segs, itertools.accumulate((len(s) for s in segs), initial=0)):
        for a in range(0, len(s), PIECE):
            z = min(a + PIECE, len(s))
            s[a:z] = buf.mv[off + a:off + z]
            h.update(s[a:z])
    got = h.hexdigest()
    if got != b.checksum:
        raise mismatch(b, got)
    return b.size


def _staging(local: threading.local, size: int) -> AlignedBuffer:
    buf = getattr(local, "staging", None)
    if buf is None or buf.size < size:
        if buf is not None:
            buf.close()
        buf = local.staging = AlignedBuffer(size)
    return buf
