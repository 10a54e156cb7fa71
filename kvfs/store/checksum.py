"""xxh3 checksums: one for the whole object, one per chunk for partial reads."""
from __future__ import annotations

import struct

import xxhash


def digest(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def chunk_sums(data: memoryview, chunk_size: int) -> tuple[int, ...]:
    n = len(data)
    return tuple(xxhash.xxh3_64_intdigest(data[i:i + chunk_size]) for i in range(0, n, chunk_size))


def summarize(data: memoryview, chunk_size: int) -> tuple[int, tuple[int, ...]]:
    """(whole-object xxh3_64, per-chunk xxh3_64s). Large buffers: run in a worker thread."""
    whole = digest(data)
    if len(data) <= chunk_size:         # one chunk: its sum is the whole object's
        return whole, (whole,) if len(data) else ()
    return whole, chunk_sums(data, chunk_size)


class Summer:
    """:func:`summarize` of bytes fed in pieces (any sizes, in order): a copy can checksum
    each piece while it is still in the CPU cache, instead of a second pass over memory."""

    def __init__(self, chunk_size: int, length: int | None = None):
        self.chunk_size = chunk_size
        # ``length`` (the bytes that will be fed) within one chunk: its sum is the whole's,
        # so the per-chunk pass is skipped
        self._one = length is not None and length <= chunk_size
        self._whole = xxhash.xxh3_64()
        self._chunk = xxhash.xxh3_64()
        self._in_chunk = 0              # bytes of the current chunk fed so far
        self._sums: list[int] = []
        self.size = 0

    def update(self, piece) -> None:
        view = memoryview(piece).cast("B")
        self._whole.update(view)
        self.size += len(view)
        if self._one:
            if self.size > self.chunk_size:
                raise ValueError("fed more bytes than the length given")
            return
        while len(view):
            take = min(len(view), self.chunk_size - self._in_chunk)
            self._chunk.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == self.chunk_size:
                self._sums.append(self._chunk.intdigest())
                self._chunk.reset()
                self._in_chunk = 0

    def result(self) -> tuple[int, tuple[int, ...]]:
        """What :func:`summarize` gives for the bytes fed."""
        whole = self._whole.intdigest()
        if self.size <= self.chunk_size:
            return whole, (whole,) if self.size else ()
        sums = self._sums + ([self._chunk.intdigest()] if self._in_chunk else [])
        return whole, tuple(sums)


def pack_sums(sums: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(sums)}Q", *sums)


def unpack_sums(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def hexdigest(value: int) -> str:
    return f"{value:016x}"
