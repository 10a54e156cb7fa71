"""Writes on a mount with FUSE passthrough on: a write-only open is ``direct_io``, so its bytes
never fill the FUSE inode's page cache, which the next passthrough open would have to drop
page by page (docs/design.md, "An open", item 3). Read-write opens keep the page cache (a
mapping needs it). Pages are counted with cachestat(2) (Linux 6.5+)."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import pytest

from support.files import MiB, content, read

pytestmark = pytest.mark.mount

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_CACHESTAT = 451            # x86_64 and arm64 (the generic table)


def cached_pages(fd: int) -> int:
    """Pages of ``fd``'s file in the page cache (cachestat(2)); skips without the call."""
    rng = (ctypes.c_uint64 * 2)(0, 0)          # offset 0, length 0: to the end
    out = (ctypes.c_uint64 * 5)()
    if _LIBC.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        pytest.skip(f"cachestat(2): {os.strerror(ctypes.get_errno())}")
    return out[0]


def counts(m) -> tuple[int, int]:
    t = m.stats()["transport"]
    return t["passthrough"]["opens"], t["data_reads"]


def test_a_write_only_open_leaves_no_pages_and_the_next_reader_passes(kvfs_mount):
    m = kvfs_mount("--passthrough", ram="64MiB")
    assert m.stats()["transport"]["passthrough"]["state"] == "on"
    data = content("w", 2 * MiB)
    p = m.path / "w.kv"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        assert os.write(fd, data) == len(data)
        assert cached_pages(fd) == 0
    finally:
        os.close(fd)
    opens, reads = counts(m)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, len(data) + 1, 0) == data
        with mmap.mmap(fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            assert mm[:] == data
    finally:
        os.close(fd)
    assert counts(m) == (opens + 1, reads), "the read right after the write was not passthrough"
    # an O_APPEND writer (direct_io too: the daemon appends at its buffer's end)
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"tail")
        os.write(fd, b"end")
    finally:
        os.close(fd)
    assert read(p) == data + b"tailend"


def test_a_read_write_open_keeps_the_page_cache(kvfs_mount):
    m = kvfs_mount("--passthrough", ram="64MiB")
    data = content("rw", MiB)
    fd = os.open(m.path / "rw.kv", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        assert cached_pages(fd) > 0
        with mmap.mmap(fd, len(data), mmap.MAP_SHARED) as mm:     # a mapping needs the cache
            mm[:4] = b"head"
            mm.flush()
        assert os.pread(fd, 8, 0) == b"head" + data[4:8]
    finally:
        os.close(fd)
    assert read(m.path / "rw.kv") == b"head" + data[4:]
