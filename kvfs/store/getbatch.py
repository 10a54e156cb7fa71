"""``.kvfs/get``: many small files' bytes in one answer (the ``gets`` member of ``Store``).

Open ``.kvfs/get`` read-write, write a request at offset 0 (the ``lookup`` grammar of
kvfs/fs/control.py: paths, ``\\0base DIR``), then read the answer::

    answer := head index pad data
    head   := "KVG1" u32(n)                         n = number of paths asked
    index  := n * (i32 errno, u32 0, u64 size, u64 xxh3_64)     little-endian, in request order
    pad    := zero bytes up to get_data_offset(n)   (the next 4 KiB boundary)
    data   := the bytes of every entry with errno 0, back to back in request order

Per entry: 0 (its ``size`` bytes are in ``data``; ``xxh3_64`` is the daemon's checksum of
the whole file, for the reader to verify), ENOENT (not a sealed regular file the caller
could open for reading through the mount: missing, a directory, being written, or
permission denied -- the answer says nothing more about it), EFBIG (past the answer's cap,
``protocol.GET_MAX`` bytes of data: ask for it again) or EIO (its bytes could not be read).

Who asks: the uid, gid and groups of the process that opened the control file, with the
same rule as ``lookup`` (search permission on every directory, read permission on the
file). The answer is built when its first byte is read, from the files' versions at that
moment, each object held (counted as open) while it is copied: a file replaced meanwhile
is answered whole in its old or its new version, never a mix. Each file counts a hit, like
an open; each ENOENT entry a miss of its namespace (``namespaces`` in ``.kvfs/stats``), like
a path past the prefix ``lookup`` found. Reading the answer again gives the same bytes until the next request.
"""
from __future__ import annotations

import bisect
import errno
import logging
from typing import Callable

from kvfs import protocol
from kvfs.errors import NoSuchObject, StoreError
from kvfs.store.cred import ROOT, Cred
from kvfs.store.objects import Obj, ObjectStore

log = logging.getLogger(__name__)


def _joined(base: bytes, path: bytes) -> str:
    """A request path with its ``base``, relative to the mount root."""
    return ((base + b"/" + path) if base else path).decode("utf-8", "surrogateescape")


class BatchGets:
    """The batched get of small files' bytes. ``prefix_objects``: Leases' (the sealed objects
    of the leading paths the caller may read)."""

    def __init__(self, store: ObjectStore, prefix_objects: Callable[[list[bytes], bytes, Cred], list[Obj]]):
        self.store = store
        self.telemetry = store.telemetry
        self.prefix_objects = prefix_objects

    def _plan(self, groups: list[tuple[bytes, list[bytes]]], cred: Cred, cap: int) -> list:
        """``[(errno, obj or None), ...]`` per path, objects held (refs) until released."""
        plan = []
        total = 0
        for base, paths in groups:
            i = 0
            while i < len(paths):
                got = self.prefix_objects(paths[i:], base, cred)
                for obj in got:
                    if total + obj.size > cap:
                        plan.append((errno.EFBIG, None))
                        continue
                    total += obj.size
                    obj.refs += 1
                    self.store.note_open(obj)
                    plan.append((0, obj))
                i += len(got)
                if i < len(paths):
                    plan.append((errno.ENOENT, None))
                    self.telemetry.miss(_joined(base, paths[i]))     # its namespace's miss, as lookup counts
                    i += 1
        return plan

    async def answer(self, groups: list[tuple[bytes, list[bytes]]], cred: Cred = ROOT,
                         cap: int = protocol.GET_MAX) -> "Pieces":
        """The ``.kvfs/get`` answer for ``groups`` (``[(base, paths), ...]``) as ``cred``: the
        index, then views of the objects' bytes (a view keeps its bytes as they were, even
        once the object is replaced or freed: nothing is copied here)."""
        plan = self._plan(groups, cred, cap)
        n = len(plan)
        head = protocol.get_answer_head(n)
        pieces: list = [memoryview(head)]
        try:
            for k, (err, obj) in enumerate(plan):
                size = digest = 0
                if obj is not None:
                    try:
                        data = await self.store.reads.read_all(obj)
                        if len(data) != obj.size:
                            raise NoSuchObject(f"object {obj.oid:x}: {len(data)} of {obj.size} bytes")
                        if obj.size:
                            pieces.append(memoryview(data).cast("B"))
                        size, digest = obj.size, obj.checksum
                    except (StoreError, OSError) as e:
                        log.warning("get: object %x unreadable (%s): EIO for its entry", obj.oid, e)
                        err = errno.EIO
                protocol.put_get_entry(head, k, err, size, digest)
        finally:
            for _, obj in plan:
                if obj is not None:
                    obj.refs -= 1
                    await self.store.release_space(obj)
        return Pieces(pieces)


class Pieces:
    """An answer made of byte views back to back; a slice within one view is not copied."""

    def __init__(self, parts: list[memoryview]):
        self.parts = parts
        self.starts = []
        pos = 0
        for p in parts:
            self.starts.append(pos)
            pos += len(p)
        self.size = pos

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, sl: slice):
        lo, hi = max(0, sl.start or 0), min(self.size, self.size if sl.stop is None else sl.stop)
        if lo >= hi:
            return b""
        i = bisect.bisect_right(self.starts, lo) - 1
        at = lo - self.starts[i]
        if at + (hi - lo) <= len(self.parts[i]):
            return self.parts[i][at:at + hi - lo]
        out = bytearray(hi - lo)
        pos = 0
        while lo + pos < hi:
            take = min(hi - lo - pos, len(self.parts[i]) - at)
            out[pos:pos + take] = self.parts[i][at:at + take]
            pos += take
            i, at = i + 1, 0
        return out
