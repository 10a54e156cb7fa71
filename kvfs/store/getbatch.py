"""``.kvfs/get``: many small files' bytes in one answer (a mixin of ``Cache``).

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
an open. Reading the answer again gives the same bytes until the next request.
"""
from __future__ import annotations

import errno
import logging

from kvfs import protocol
from kvfs.errors import NoSuchObject, StoreError
from kvfs.store.cred import ROOT, Cred

log = logging.getLogger(__name__)


class BatchGets:
    """``Cache``'s batched get of small files' bytes."""

    def _get_plan(self, groups: list[tuple[bytes, list[bytes]]], cred: Cred, cap: int) -> list:
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
                    i += 1
        return plan

    async def get_answer(self, groups: list[tuple[bytes, list[bytes]]], cred: Cred = ROOT,
                         cap: int = protocol.GET_MAX) -> memoryview:
        """The ``.kvfs/get`` answer for ``groups`` (``[(base, paths), ...]``) as ``cred``."""
        plan = self._get_plan(groups, cred, cap)
        n = len(plan)
        start = protocol.get_data_offset(n)
        out = bytearray(start + sum(obj.size for _, obj in plan if obj is not None))
        protocol.GET_HEAD.pack_into(out, 0, protocol.GET_MAGIC, n)
        pos = start
        try:
            for k, (err, obj) in enumerate(plan):
                size = digest = 0
                if obj is not None:
                    try:
                        data = await self.store.read_all(obj)
                        if len(data) != obj.size:
                            raise NoSuchObject(f"object {obj.oid:x}: {len(data)} of {obj.size} bytes")
                        out[pos:pos + obj.size] = data
                        size, digest = obj.size, obj.checksum
                        pos += size
                    except (StoreError, OSError) as e:
                        log.warning("get: object %x unreadable (%s): EIO for its entry", obj.oid, e)
                        err = errno.EIO
                protocol.GET_ENTRY.pack_into(out, protocol.GET_HEAD.size + protocol.GET_ENTRY.size * k,
                                             err, 0, size, digest)
        finally:
            for _, obj in plan:
                if obj is not None:
                    obj.refs -= 1
                    await self.store.release_space(obj)
        return memoryview(out)[:pos]
