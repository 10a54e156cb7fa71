"""kvfs/store/versions.py: a handle's bytes fitted to the inode's current size (issue 32)."""
from __future__ import annotations

import pytest

from kvfs.store.versions import fit

OLD = bytes(range(1, 101))        # a 100-byte version, no zero byte in it


@pytest.mark.parametrize("offset,size,cur,want", [
    (0, 50, 100, OLD[:50]),                          # the current version: as it is
    (90, 50, 100, OLD[90:]),                         # EOF at its end
    (90, 50, 130, OLD[90:] + bytes(30)),             # grown: its bytes, then zeros to the size
    (100, 50, 130, bytes(30)),                       # past its end, inside the size: zeros
    (120, 50, 130, bytes(10)),
    (130, 50, 130, b""),                             # EOF at the current size
    (0, 50, 30, OLD[:30]),                           # shrunk: cut at the current size
    (40, 50, 30, b""),
    (0, 200, 250, OLD + bytes(100)),                 # the read asked 200 bytes
])
def test_fit_to_the_current_size(offset, size, cur, want):
    data = memoryview(OLD)[offset:offset + size]     # what the content read gives
    got = fit(data, offset, size, len(OLD), cur)
    assert bytes(got) == want


def test_fit_of_an_inode_gone_from_the_namespace_is_the_content():
    assert bytes(fit(memoryview(OLD)[90:], 90, 50, len(OLD), None)) == OLD[90:]


def test_fit_returns_the_same_buffer_when_nothing_changes():
    mv = memoryview(OLD)[10:20]
    assert fit(mv, 10, 10, len(OLD), 100) is mv     # no copy on the common path
