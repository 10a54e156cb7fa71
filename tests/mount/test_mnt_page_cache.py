"""Versions against the kernel's per-inode page cache, on a real mount.

Issue 2 section 2: "readers that opened the old version keep reading it"; "a replaced name
must not serve stale bytes". kvfs/fs/ops.py tracks which version the cached pages hold and
gives direct_io to a handle opened while another version is open.
"""
from __future__ import annotations

import os

import pytest

from mounthelp import MiB, content, open_mount, put, read
from mounthelp import d, mnt  # noqa: F401 - shared fixtures

pytestmark = pytest.mark.mount



@pytest.mark.parametrize("how", ["rewrite", "trunc"])
def test_old_reader_keeps_old_version(d, how):
    size = 3 * MiB
    v1, v2 = content("v1", size), content("v2", size)
    put(d / "f", v1)
    r = os.open(d / "f", os.O_RDONLY)
    try:
        assert os.pread(r, 4096, 0) == v1[:4096]          # the page cache holds v1 now
        flags = os.O_WRONLY | (os.O_TRUNC if how == "trunc" else 0)
        w = os.open(d / "f", flags)
        try:
            os.pwrite(w, v2, 0)
        finally:
            os.close(w)                                   # v2 installed here
        old = os.pread(r, size + 1, 0)
        if old != v1:
            same_as_v2 = old == v2
            first_bad = next(i for i in range(min(len(old), size)) if old[i] != v1[i]) if len(old) else 0
            pytest.fail(f"the reader that opened v1 read {len(old)} bytes that are not v1 "
                        f"(equal to v2: {same_as_v2}; first differing byte at {first_bad})")
        # a new open sees v2, even though the old reader just re-filled the page cache
        assert read(d / "f") == v2, "a new open served the old version"
    finally:
        os.close(r)
    assert read(d / "f") == v2


def test_old_reader_during_rewrite_keeps_old_version(d):
    """The rewrite is still open (not sealed): the old reader must not see its bytes either."""
    size = 2 * MiB
    v1, v2 = content("w1", size), content("w2", size)
    put(d / "f", v1)
    r = os.open(d / "f", os.O_RDONLY)
    try:
        assert os.pread(r, size, 0) == v1
        w = os.open(d / "f", os.O_WRONLY)
        try:
            os.pwrite(w, v2, 0)
            mid = os.pread(r, size, 0)
            assert mid == v1, (f"while a rewrite was open, the old reader read new bytes "
                               f"(equal to the unsealed v2: {mid == v2})")
        finally:
            os.close(w)
        assert os.pread(r, size, 0) == v1
    finally:
        os.close(r)
    assert read(d / "f") == v2
