"""The pyfuse3 handlers called directly, without the kernel: every store error becomes an errno."""
from __future__ import annotations

import errno
import json
import os
import types

import pyfuse3
import pytest
import xxhash


from kvfs.build import build_ops  # noqa: E402
from kvfs.fs import control  # noqa: E402
from kvfs.store.index import ROOT_INO  # noqa: E402
from support.store import open_store  # noqa: E402

CTX = types.SimpleNamespace(uid=0, gid=0, pid=os.getpid(), umask=0o022)


async def fuse_errno(coro) -> int:
    """The errno a handler answers; a lookup's negative entry (st_ino 0) counts as ENOENT."""
    try:
        res = await coro
    except pyfuse3.FUSEError as e:
        return e.errno
    if isinstance(res, pyfuse3.EntryAttributes) and res.st_ino == 0:
        assert res.entry_timeout > 0            # cached by the kernel, not a bare miss
        return errno.ENOENT
    pytest.fail(f"expected an error, got {res!r}")


async def put(ops, parent, name: bytes, data: bytes):
    fi, attr = await ops.create(parent, name, 0o644, os.O_WRONLY, CTX)
    assert await ops.write(fi.fh, 0, data) == len(data)
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    return attr.st_ino


async def get(ops, ino, size=1 << 30) -> bytes:
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    try:
        return bytes(await ops.read(fi.fh, 0, size))
    finally:
        await ops.release(fi.fh)


@pytest.fixture
async def ops(tmp_path):
    async with open_store(tmp_path) as kvstore:
        yield build_ops(kvstore, lambda: {"pid": os.getpid()})


async def test_write_read_and_attributes(ops):
    d = await ops.mkdir(ROOT_INO, b"dir", 0o755, CTX)
    data = os.urandom(300_000)
    ino = await put(ops, d.st_ino, b"blk", data)
    assert (await ops.lookup(d.st_ino, b"blk", CTX)).st_size == len(data)
    assert await get(ops, ino) == data
    assert await ops.getxattr(ino, b"user.kvfs.checksum", CTX) == xxhash.xxh3_64_hexdigest(data).encode()
    assert await ops.getxattr(ino, b"user.kvfs.tier", CTX) == b"ram"


async def test_errnos(ops):
    assert await fuse_errno(ops.lookup(ROOT_INO, b"missing", CTX)) == errno.ENOENT
    assert await fuse_errno(ops.lookup(ROOT_INO, b"x" * 256, CTX)) == errno.ENAMETOOLONG
    assert await fuse_errno(ops.mkdir(ROOT_INO, b".kvfs", 0o755, CTX)) == errno.EPERM
    d = await ops.mkdir(ROOT_INO, b"d", 0o755, CTX)
    assert await fuse_errno(ops.mkdir(ROOT_INO, b"d", 0o755, CTX)) == errno.EEXIST
    f = await put(ops, d.st_ino, b"f", b"hello")
    assert await fuse_errno(ops.rmdir(ROOT_INO, b"d", CTX)) == errno.ENOTEMPTY
    assert await fuse_errno(ops.unlink(ROOT_INO, b"d", CTX)) == errno.EISDIR
    assert await fuse_errno(ops.rmdir(d.st_ino, b"f", CTX)) == errno.ENOTDIR
    assert await fuse_errno(ops.link(f, ROOT_INO, b"hard", CTX)) == errno.EPERM
    sub = await ops.mkdir(d.st_ino, b"sub", 0o755, CTX)
    assert await fuse_errno(ops.rename(ROOT_INO, b"d", sub.st_ino, b"loop", 0, CTX)) == errno.EINVAL
    await put(ops, ROOT_INO, b"g", b"x")
    assert await fuse_errno(ops.rename(ROOT_INO, b"g", d.st_ino, b"f", 1, CTX)) == errno.EEXIST  # NOREPLACE
    assert await fuse_errno(ops.rename(ROOT_INO, b"g", d.st_ino, b"sub", 0, CTX)) == errno.EISDIR
    assert await fuse_errno(ops.getxattr(f, b"user.other", CTX)) == errno.ENODATA
    assert await fuse_errno(ops.setxattr(f, b"user.kvfs.tier", b"nvme", CTX)) == errno.EPERM
    assert await fuse_errno(ops.setxattr(f, b"user.kvfs.checksum", b"0", CTX)) == errno.EPERM
    assert await fuse_errno(ops.setxattr(f, b"user.kvfs.pin", b"yes", CTX)) == errno.EINVAL
    assert await fuse_errno(ops.setxattr(f, b"trusted.x", b"1", CTX)) == errno.ENOTSUP
    assert await fuse_errno(ops.removexattr(f, b"user.kvfs.pin", CTX)) == errno.EPERM


async def test_replace_keeps_old_reader(ops):
    await put(ops, ROOT_INO, b"final", b"old" * 1000)
    old_ino = (await ops.lookup(ROOT_INO, b"final", CTX)).st_ino
    reader = await ops.open(old_ino, os.O_RDONLY, CTX)
    await put(ops, ROOT_INO, b"final.tmp", b"new" * 1000)
    await ops.rename(ROOT_INO, b"final.tmp", ROOT_INO, b"final", 0, CTX)
    new_ino = (await ops.lookup(ROOT_INO, b"final", CTX)).st_ino
    assert await get(ops, new_ino) == b"new" * 1000
    assert bytes(await ops.read(reader.fh, 0, 10_000)) == b"old" * 1000
    await ops.release(reader.fh)
    assert await fuse_errno(ops.lookup(ROOT_INO, b"final.tmp", CTX)) == errno.ENOENT


async def test_pin_and_user_xattrs(ops):
    f = await put(ops, ROOT_INO, b"f", b"data")
    await ops.setxattr(f, b"user.kvfs.pin", b"1\n", CTX)
    assert await ops.getxattr(f, b"user.kvfs.pin", CTX) == b"1"
    await ops.setxattr(f, b"user.note", b"hello", CTX)
    assert await ops.getxattr(f, b"user.note", CTX) == b"hello"
    assert b"user.note" in await ops.listxattr(f, CTX)
    await ops.removexattr(f, b"user.note", CTX)
    assert await fuse_errno(ops.getxattr(f, b"user.note", CTX)) == errno.ENODATA


async def test_control_stats_and_lookup(ops):
    d = await ops.mkdir(ROOT_INO, b"ns", 0o755, CTX)
    for i in range(3):
        await put(ops, d.st_ino, b"b%d" % i, b"x" * (i + 1))
    ctl = await ops.lookup(ROOT_INO, b".kvfs", CTX)
    st = await ops.lookup(ctl.st_ino, b"stats", CTX)
    fi = await ops.open(st.st_ino, os.O_RDONLY, CTX)
    doc = json.loads(await ops.read(fi.fh, 0, 1 << 20))
    await ops.release(fi.fh)
    assert doc["pid"] == os.getpid() and set(doc["tiers"]) == {"ram", "nvme"}
    lk = await ops.lookup(ctl.st_ino, b"lookup", CTX)
    fi = await ops.open(lk.st_ino, os.O_RDWR, CTX)
    req = b"\n".join([b"ns/b0", b"ns/b1", b"ns/missing", b"ns/b2"])
    await ops.write(fi.fh, 0, req)
    assert json.loads(await ops.read(fi.fh, 0, 4096))["prefix"] == 2
    await ops.write(fi.fh, 0, b"ns/b0\nns/b1\nns/b2\n")          # a new request on the same handle
    assert json.loads(await ops.read(fi.fh, 0, 4096)) == {"prefix": 3, "tiers": ["ram"] * 3}
    await ops.release(fi.fh)
    assert await fuse_errno(ops.open(st.st_ino, os.O_WRONLY, CTX)) == errno.EACCES
    assert control.is_control(st.st_ino)


async def test_corrupt_nvme_object_is_eio_and_dropped(ops):
    kvstore = ops.store
    data = os.urandom(200_000)
    ino = await put(ops, ROOT_INO, b"victim", data)
    obj = kvstore.store.objs[kvstore.files.getattr(ino).oid]
    await kvstore.store.mover.demote(obj, 0)
    assert await ops.getxattr(ino, b"user.kvfs.tier", CTX) == b"nvme"
    path = kvstore.store.tiers[1].path(obj.oid)
    raw = bytearray(path.read_bytes())
    raw[123_456] ^= 0x01
    path.write_bytes(bytes(raw))
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    assert await fuse_errno(ops.read(fi.fh, 0, 1 << 20)) == errno.EIO
    await ops.release(fi.fh)
    assert await fuse_errno(ops.lookup(ROOT_INO, b"victim", CTX)) == errno.ENOENT
    assert kvstore.store.statistics()["nvme"]["checksum_failures"] == 1


async def test_enospc_when_everything_is_pinned(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, nvme=2 << 20) as kvstore:
        ops = build_ops(kvstore, dict)
        for i in range(6):
            ino = await put(ops, ROOT_INO, b"p%d" % i, os.urandom(500_000))
            await ops.setxattr(ino, b"user.kvfs.pin", b"1", CTX)
            await kvstore.store.mover.relieve()
        fi, _ = await ops.create(ROOT_INO, b"big", 0o644, os.O_WRONLY, CTX)
        await ops.write(fi.fh, 0, os.urandom(1_500_000))
        assert await fuse_errno(ops.flush(fi.fh)) == errno.ENOSPC
        await ops.release(fi.fh)
        assert await fuse_errno(ops.lookup(ROOT_INO, b"big", CTX)) == errno.ENOENT
        for i in range(6):
            assert (await ops.lookup(ROOT_INO, b"p%d" % i, CTX)).st_size == 500_000
