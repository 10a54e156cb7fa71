"""Versions (reopen for write while a reader holds the old one), xattrs, checksums, and .kvfs."""
from __future__ import annotations

import errno
import json
import os

import pytest
import xxhash

from support.files import MiB, content, errno_of, put, read, xattr
from support.mount import open_mount
from support.mount import d, mnt  # noqa: F401 - shared fixtures

pytestmark = pytest.mark.mount



# ---- versions -----------------------------------------------------------------
def test_new_open_after_rewrite_sees_new_bytes(d):
    v1, v2 = content("a", 2 * MiB), content("b", 2 * MiB)
    put(d / "f", v1)
    assert read(d / "f") == v1
    with open(d / "f", "r+b") as f:
        f.write(v2)
    assert read(d / "f") == v2
    with open(d / "f", "r+b") as f:           # partial in-place rewrite
        f.seek(MiB)
        f.write(b"Z" * 10)
    assert read(d / "f") == v2[:MiB] + b"Z" * 10 + v2[MiB + 10:]


def test_reader_during_write_sees_staged_bytes(d):
    w = os.open(d / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(w, b"hello")
        r = os.open(d / "f", os.O_RDONLY)
        try:
            assert os.pread(r, 100, 0) == b"hello"
        finally:
            os.close(r)
    finally:
        os.close(w)
    assert read(d / "f") == b"hello"


# ---- xattrs ---------------------------------------------------------------------
def test_kvfs_xattrs(d):
    data = content("x", MiB + 5)
    put(d / "f", data)
    assert xattr(d / "f", "user.kvfs.tier") == "ram"
    assert xattr(d / "f", "user.kvfs.checksum") == xxhash.xxh3_64(data).hexdigest()
    assert xattr(d / "f", "user.kvfs.pin") == "0"
    names = os.listxattr(d / "f")
    for n in ("user.kvfs.tier", "user.kvfs.checksum", "user.kvfs.pin"):
        assert n in names
    for ro in ("user.kvfs.tier", "user.kvfs.checksum"):
        assert errno_of(os.setxattr, d / "f", ro, b"nvme") == errno.EPERM
        assert errno_of(os.removexattr, d / "f", ro) == errno.EPERM
    assert xattr(d / "f", "user.kvfs.tier") == "ram"
    os.setxattr(d / "f", "user.kvfs.pin", b"1")
    assert xattr(d / "f", "user.kvfs.pin") == "1"
    os.setxattr(d / "f", "user.kvfs.pin", b"0")
    assert xattr(d / "f", "user.kvfs.pin") == "0"
    for bad in (b"2", b"yes", b"", b"-1", b"10"):
        assert errno_of(os.setxattr, d / "f", "user.kvfs.pin", bad) == errno.EINVAL, bad
    assert xattr(d / "f", "user.kvfs.pin") == "0"
    assert errno_of(os.setxattr, d / "f", "user.kvfs.nonsense", b"1") in (errno.EPERM, errno.EINVAL)
    assert read(d / "f") == data


def test_checksum_matches_content_for_many_sizes(d):
    for size in (0, 1, 4095, 4096, MiB - 1, MiB, MiB + 1, 3 * MiB + 777):
        data = content(f"c{size}", size)
        put(d / f"f{size}", data)
        if size:
            assert xattr(d / f"f{size}", "user.kvfs.checksum") == xxhash.xxh3_64(data).hexdigest(), size
    # after a rewrite the checksum follows the new content
    data = content("again", 12345)
    put(d / "f1", data)
    assert xattr(d / "f1", "user.kvfs.checksum") == xxhash.xxh3_64(data).hexdigest()


def test_user_xattrs_stored_listed_removed(d):
    put(d / "f", b"data")
    os.setxattr(d / "f", "user.model", b"llama-3-8b")
    os.setxattr(d / "f", "user.bin", bytes(range(256)))
    assert os.getxattr(d / "f", "user.model") == b"llama-3-8b"
    assert os.getxattr(d / "f", "user.bin") == bytes(range(256))
    names = os.listxattr(d / "f")
    assert "user.model" in names and "user.bin" in names
    os.setxattr(d / "f", "user.model", b"other")
    assert os.getxattr(d / "f", "user.model") == b"other"
    assert errno_of(os.setxattr, d / "f", "user.model", b"x", os.XATTR_CREATE) == errno.EEXIST
    assert errno_of(os.setxattr, d / "f", "user.new", b"x", os.XATTR_REPLACE) == errno.ENODATA
    os.removexattr(d / "f", "user.model")
    assert "user.model" not in os.listxattr(d / "f")
    assert errno_of(os.getxattr, d / "f", "user.model") == errno.ENODATA
    assert errno_of(os.removexattr, d / "f", "user.model") == errno.ENODATA
    # on directories too
    os.mkdir(d / "dir")
    os.setxattr(d / "dir", "user.tag", b"t")
    assert os.getxattr(d / "dir", "user.tag") == b"t"
    # xattrs survive a new version of the file
    put_inplace = open(d / "f", "r+b")
    put_inplace.write(b"DATA")
    put_inplace.close()
    assert os.getxattr(d / "f", "user.bin") == bytes(range(256))


def test_non_user_namespace_refused(d):
    put(d / "f", b"x")
    for name in ("trusted.foo", "security.foo", "system.foo"):
        code = errno_of(os.setxattr, d / "f", name, b"1")
        assert code in (errno.ENOTSUP, errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL), (name, code)
        assert name not in os.listxattr(d / "f")


# ---- .kvfs ---------------------------------------------------------------------------
def test_stats_json(mnt):
    doc = json.loads(read(mnt.path / ".kvfs" / "stats"))
    for tier in ("ram", "nvme"):
        t = doc["tiers"][tier]
        for key in ("capacity", "used", "objects", "hits", "misses", "bytes_read", "bytes_written",
                    "demotions", "promotions", "evictions", "checksum_failures"):
            assert isinstance(t[key], int) and t[key] >= 0, (tier, key)
    assert doc["tiers"]["ram"]["capacity"] == 64 * MiB
    assert errno_of(open, mnt.path / ".kvfs" / "stats", "wb") in (errno.EACCES, errno.EPERM)


def test_lookup_protocol(mnt, d):
    rel = d.relative_to(mnt.path)
    for i in range(5):
        put(d / f"p{i}.bin", content(f"p{i}", 1000))
    os.mkdir(d / "adir")
    paths = [f"{rel}/p0.bin", f"{rel}/p1.bin", f"/{rel}/p2.bin", f"{rel}/missing.bin", f"{rel}/p4.bin"]
    fd = os.open(mnt.path / ".kvfs" / "lookup", os.O_RDWR)
    try:
        os.write(fd, ("\n".join(paths) + "\n").encode())
        ans = json.loads(os.pread(fd, 1 << 16, 0))
        assert ans == {"prefix": 3, "tiers": ["ram", "ram", "ram"]}
        # a second request on the same handle
        os.write(fd, f"{rel}/p0.bin\n{rel}/p1.bin\n{rel}/p2.bin\n{rel}/p3.bin\n{rel}/p4.bin".encode())
        ans = json.loads(os.pread(fd, 1 << 16, 0))
        assert ans["prefix"] == 5 and len(ans["tiers"]) == 5
        os.write(fd, f"{rel}/adir\n{rel}/p0.bin\n".encode())           # a directory is not cached
        assert json.loads(os.pread(fd, 1 << 16, 0))["prefix"] == 0
        os.write(fd, b"nothing/here\n")
        assert json.loads(os.pread(fd, 1 << 16, 0)) == {"prefix": 0, "tiers": []}
    finally:
        os.close(fd)
