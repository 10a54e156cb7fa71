"""checksum.Summer (the checksums a copy takes piece by piece) against checksum.summarize."""
from __future__ import annotations

import random

import pytest

from kvfs.store.checksum import Summer, summarize

CHUNK = 1 << 20


@pytest.mark.parametrize("size", [0, 1, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 777])
@pytest.mark.parametrize("piece", [4096, 65537, 256 << 10, 4 * CHUNK])
def test_summer_fed_in_pieces_gives_what_summarize_gives(size, piece):
    data = random.Random(size).randbytes(size)
    for s in (Summer(CHUNK), Summer(CHUNK, size)):      # told the length: one chunk hashed once
        for i in range(0, size, piece):
            s.update(memoryview(data)[i:i + piece])
        assert s.result() == summarize(memoryview(data), CHUNK)
        assert s.size == size


def test_a_summer_told_one_chunk_refuses_more():
    s = Summer(CHUNK, 10)
    s.update(b"x" * CHUNK)
    with pytest.raises(ValueError):
        s.update(b"x")


def test_summer_pieces_of_uneven_sizes_across_chunk_boundaries():
    data = random.Random(7).randbytes(2 * CHUNK + 5)
    s = Summer(CHUNK)
    at, r = 0, random.Random(8)
    while at < len(data):
        n = r.randint(1, 300_000)
        s.update(data[at:at + n])
        at += n
    assert s.result() == summarize(memoryview(data), CHUNK)
