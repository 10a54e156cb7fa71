"""What the kernel may cache on a kvfs mount, and that it never hides or serves stale state.

kvfs/fs/ops.py answers a missing name with a negative entry (the kernel remembers the miss),
so a name must become visible however it appears afterwards: create, O_EXCL temp + rename
(vLLM, SGLang), mkdir races (vLLM's 16 writer threads), symlink. A seal keeps the kernel's
pages and attributes when they hold the sealed bytes, and drops them when they may not.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import pytest

from support.files import content, put, read
from support.mount import d, mnt  # noqa: F401 - shared fixtures

pytestmark = pytest.mark.mount


def _missing_twice(p) -> None:
    for _ in range(2):                          # the second miss is the kernel's cached one
        assert not os.path.exists(p)
        with pytest.raises(FileNotFoundError):
            os.stat(p)


@pytest.mark.parametrize("how", ["create", "rename", "mkdir", "symlink"])
def test_a_name_missed_twice_appears_when_made(d, how):
    p = d / "name"
    _missing_twice(p)
    data = content(how, 40_000)
    if how == "create":
        fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, data)
        os.close(fd)
    elif how == "rename":
        fd = os.open(d / "name.bin_1234.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, data)
        os.close(fd)
        os.rename(d / "name.bin_1234.tmp", p)
        _missing_twice(d / "name.bin_1234.tmp")
    elif how == "mkdir":
        os.mkdir(p)
    else:
        put(d / "target", data)
        os.symlink("target", p)
    assert os.path.exists(p) and os.access(p, os.F_OK) and os.access(p, os.R_OK)
    if how != "mkdir":
        assert read(p) == data
    # gone again: the miss is seen, then the name comes back
    if how == "mkdir":
        os.rmdir(p)
    else:
        os.unlink(p)
    _missing_twice(p)
    put(p, data[:100])
    assert read(p) == data[:100]


def test_makedirs_race_after_misses(d):
    """vLLM: 16 threads ``makedirs(exist_ok=True)`` the same parents after checking blocks there."""
    leaf = d / "m_abc" / "abc" / "de_g0"
    _missing_twice(leaf / "h.bin")
    errors = []

    def work(i):
        try:
            os.makedirs(leaf, exist_ok=True)
            put(leaf / f"{i}.bin", content(str(i), 4096))
        except OSError as e:                  # noqa: PERF203
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(os.listdir(leaf)) == sorted(f"{i}.bin" for i in range(16))
    assert all(read(leaf / f"{i}.bin") == content(str(i), 4096) for i in range(16))


def test_o_excl_still_fails_on_an_existing_name(d):
    put(d / "x", b"1")
    with pytest.raises(FileExistsError):
        os.open(d / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    assert read(d / "x") == b"1"


def _resident_pages(path) -> int:
    """Pages of ``path`` in the kernel's page cache (mincore over a fresh mapping, no read)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)
    finally:
        libc.munmap(addr, size)


def test_pages_and_mtime_survive_the_seal(d):
    """Issue 12: the seal of a sole buffered writer keeps the kernel's pages and attributes
    (they hold the sealed bytes), and is not a modification of its own (same mtime)."""
    data = content("pages", 1 << 20)
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, data)
        during = os.fstat(fd)
    finally:
        os.close(fd)                                   # the seal
    after = os.stat(p)
    assert (after.st_size, after.st_mtime_ns) == (len(data), during.st_mtime_ns)
    assert _resident_pages(p) == len(data) // mmap.PAGESIZE, "the seal dropped the written pages"
    assert read(p) == data
    assert os.stat(p).st_mtime_ns == during.st_mtime_ns


def test_a_rewrite_moves_mtime_and_is_read_back(d):
    p = d / "f"
    put(p, content("v1", 300_000))
    before = os.stat(p).st_mtime_ns
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, b"new", 10)
    finally:
        os.close(fd)
    v2 = bytearray(content("v1", 300_000))
    v2[10:13] = b"new"
    assert os.stat(p).st_mtime_ns > before
    assert read(p) == bytes(v2)


def test_o_direct_and_append_writers_are_read_back(d):
    """Writes that may bypass the pages (O_DIRECT) or land where the daemon says (O_APPEND)
    make the seal drop the pages: the next reader gets the sealed bytes."""
    buf = mmap.mmap(-1, 1 << 20)
    buf[:] = content("direct", 1 << 20)
    p = d / "direct"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, buf) == len(buf)
    finally:
        os.close(fd)
    assert read(p) == bytes(buf)
    q = d / "append"
    put(q, b"a" * 5000)
    assert read(q) == b"a" * 5000                    # pages cached
    fd = os.open(q, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"b" * 3000)
    finally:
        os.close(fd)
    assert read(q) == b"a" * 5000 + b"b" * 3000
