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


def pack_sums(sums: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(sums)}Q", *sums)


def unpack_sums(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def hexdigest(value: int) -> str:
    return f"{value:016x}"
