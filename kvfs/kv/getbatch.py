"""Client of ``.kvfs/get``: the bytes of many small files of a kvfs mount in one request
and one large read, landing straight in the caller's buffers, each file verified by the
daemon's xxh3_64 (the answer's layout: kvfs/store/getbatch.py).

For files without a fast path (below the RAM tier's ``ram_mapped_min`` a file lives in the
daemon's memory, so a lease has no backing file to name): one request instead of an
open + read + close through the mount per file.
"""
from __future__ import annotations

import errno
import logging
import os
import threading

import xxhash

from kvfs import protocol
from kvfs.kv.blockio import preadv_full

log = logging.getLogger(__name__)

EBADMSG = errno.EBADMSG     # an entry whose bytes failed the checksum
_IOV_MAX = 512              # buffers per preadv (the kernel's limit is 1024)


class GetClient:
    """Batched gets of files under ``root`` (a directory in the kvfs mount at ``mount_root``)."""

    def __init__(self, mount_root: str, root: str):
        self.base = os.path.relpath(os.path.realpath(root), mount_root)
        self._fd = os.open(os.path.join(mount_root, protocol.CONTROL_NAME, protocol.GET_FILE), os.O_RDWR)
        self._lock = threading.Lock()

    @classmethod
    def open(cls, mount_root: str | None, root: str) -> "GetClient | None":
        if mount_root is None:
            return None
        try:
            return cls(mount_root, root)
        except OSError as e:            # an older daemon without .kvfs/get
            log.debug("no get file under %s: %s", mount_root, e)
            return None

    def get_into(self, rels: list[str], dests: list[list[memoryview]]) -> list[int]:
        """Read file ``rels[i]`` (relative to the root) into ``dests[i]`` (its destination
        buffers, in file order; their total is the size the file must have). One errno per
        file: 0 = read whole and verified; ENOENT absent or not readable by the caller;
        EBADMSG checksum mismatch; EIO wrong size or unreadable; EFBIG not answered. A
        failed file's buffers may hold garbage. A dead daemon raises OSError (ENOTCONN)."""
        sizes = [sum(len(s) for s in d) for d in dests]
        results = [errno.EFBIG] * len(rels)
        start = 0
        while start < len(rels):         # requests of at most GET_MAX bytes of data each
            end, total = start + 1, sizes[start]
            while end < len(rels) and total + sizes[end] <= protocol.GET_MAX:
                total += sizes[end]
                end += 1
            results[start:end] = self._request(rels[start:end], dests[start:end], sizes[start:end])
            start = end
        return results

    def _request(self, rels: list[str], dests: list[list[memoryview]], sizes: list[int]) -> list[int]:
        n = len(rels)
        req = protocol.request(self.base, rels)
        data_at = protocol.get_data_offset(n)
        with self._lock:
            view, done = memoryview(req), 0
            while done < len(req):
                done += os.pwrite(self._fd, view[done:], done)
            head = os.pread(self._fd, data_at, 0)
            try:
                index = protocol.decode_get_index(head, n)
            except (ValueError, TypeError) as e:
                raise OSError(errno.EPROTO, f"bad .kvfs/get answer: {e}") from None
            segs: list = []
            results = []
            for (err, size, _), want, dest in zip(index, sizes, dests):
                if err == 0 and size != want:       # another geometry: read past it, a miss
                    segs.append(bytearray(size))
                    err = errno.EIO
                elif err == 0:
                    segs.extend(dest)
                results.append(err)
            total = sum(size for err, size, _ in index if err == 0)
            got = 0
            for i in range(0, len(segs), _IOV_MAX):
                part = segs[i:i + _IOV_MAX]
                want = sum(len(s) for s in part)
                got += preadv_full(self._fd, part, data_at + got, want)
        if got != total:
            raise OSError(errno.EIO, f".kvfs/get answer short: {got} of {total} bytes")
        for i, (err, _, digest) in enumerate(index):
            if results[i] == 0 and _digest(dests[i]) != digest:
                log.warning("%s: xxh3_64 mismatch in .kvfs/get answer", rels[i])
                results[i] = EBADMSG
        return results

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)     # the descriptor is gone even when a dead daemon fails the close
            except OSError as e:
                log.debug("closing .kvfs/get: %s", e)


def _digest(segs: list[memoryview]) -> int:
    if len(segs) == 1:
        return xxhash.xxh3_64_intdigest(segs[0])
    h = xxhash.xxh3_64()
    for s in segs:
        h.update(s)
    return h.intdigest()
