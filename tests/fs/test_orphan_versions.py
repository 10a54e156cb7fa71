"""A file removed from the namespace (unlinked, or replaced by a rename over its name) while a
writer and a reader of its older version have it open: the inode lives on as an orphan, and
the reader's descriptor is still told the inode's one size, the writer's (docs/design.md,
"Versions and sizes"). Its reads must agree with that size: its version's bytes, then zeros,
never EOF inside it (fsx seed 802: ``pread old version (f36, 2023, 5548): kvfs b''``), and the
writer keeps reading what it wrote. Handler calls in one trio run, no kernel, so each
interleaving is the one named in the test."""
from __future__ import annotations

import os
import types

import pytest
import trio

from kvfs.build import build_ops
from kvfs.store.index import ROOT_INO
from support.store import open_store

CTX = types.SimpleNamespace(uid=0, gid=0, pid=os.getpid(), umask=0o022)
SIZE = 3 << 20          # hashed in a worker thread: a seal waits, other requests run meanwhile


def content(seed: int, n: int) -> bytes:
    block = bytes((seed * 131 + i) % 251 for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


@pytest.fixture
async def ops(tmp_path):
    async with open_store(tmp_path, ram=32 << 20, nvme=64 << 20) as kvstore:
        yield build_ops(kvstore, lambda: {"pid": os.getpid()})


async def sealed_file(ops, name: bytes, data: bytes) -> int:
    fi, attr = await ops.create(ROOT_INO, name, 0o644, os.O_WRONLY, CTX)
    await ops.write(fi.fh, 0, data)
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    return attr.st_ino


async def read_all(ops, fh, size: int) -> bytes:
    return bytes(await ops.read(fh, 0, size + 4096))


async def remove(ops, how: str) -> None:
    if how == "unlink":
        await ops.unlink(ROOT_INO, b"f", CTX)
    else:                                   # a runtime's replace: another file renamed over it
        await sealed_file(ops, b"g", content(9, 1000))
        await ops.rename(ROOT_INO, b"g", ROOT_INO, b"f", 0, CTX)


async def check_old_reader(ops, ino: int, fh: int, old: bytes) -> None:
    """The reader's reads agree with the size the inode reports: its version, then zeros."""
    size = (await ops.getattr(ino, CTX)).st_size
    want = old[:size] + bytes(max(0, size - len(old)))
    assert await read_all(ops, fh, size) == want
    for off, ln in ((max(0, len(old) - 10), 2023), (len(old) + 5548, 2023), (max(0, size - 1), 10), (size, 10)):
        assert bytes(await ops.read(fh, off, ln)) == want[off:off + ln], (off, ln, size)


@pytest.mark.parametrize("how", ["unlink", "rename_over"])
@pytest.mark.parametrize("seal", ["close", "flush_then_close"])
async def test_old_reader_of_a_file_removed_while_written_reads_zeros_up_to_the_writers_size(ops, how, seal):
    # the old version empty: a reader of a non-empty sealed version would have the writer's
    # open by the name renew the name (its own inode, docs/design.md "Versions and sizes");
    # an empty one's reader (a new name opened O_RDONLY|O_CREAT) shares the writer's inode
    old, new = b"", content(2, 362_860)
    ino = await sealed_file(ops, b"f", old)
    r = await ops.open(ino, os.O_RDONLY, CTX)                 # the old version
    w = await ops.open(ino, os.O_RDWR, CTX)
    await ops.write(w.fh, 0, new)
    await remove(ops, how)                                    # the inode is an orphan now
    await check_old_reader(ops, ino, r.fh, old)
    if seal == "flush_then_close":                            # sealed while the writer stays open
        await ops.flush(w.fh)
        assert await read_all(ops, w.fh, len(new)) == new
        await check_old_reader(ops, ino, r.fh, old)
    await ops.flush(w.fh)
    await ops.release(w.fh)                                   # the writer's version is the orphan's
    assert (await ops.getattr(ino, CTX)).st_size == len(new)
    await check_old_reader(ops, ino, r.fh, old)
    await ops.release(r.fh)
    assert ino not in ops.store.ns.orphans


@pytest.mark.parametrize("how", ["unlink", "rename_over"])
async def test_a_file_removed_while_its_seal_runs_keeps_the_writers_bytes_and_size(ops, how):
    # the seal found the name, then it went while the buffer was hashed: the install finds no
    # record. The writer (its descriptor still open: the seal was a flush) reads what it
    # wrote, its next write starts from it, and the old reader sees the writer's size
    old, new = b"", content(4, SIZE)              # empty: shares the writer's inode (above)
    ino = await sealed_file(ops, b"f", old)
    r = await ops.open(ino, os.O_RDONLY, CTX)
    w = await ops.open(ino, os.O_RDWR, CTX)
    await ops.write(w.fh, 0, new)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(ops.flush, w.fh)
            while ops.store.files.writers[ino].sealing is None:
                await trio.sleep(0)
            await remove(ops, how)
    assert (await ops.getattr(ino, CTX)).st_size == len(new)
    assert await read_all(ops, w.fh, len(new)) == new
    await check_old_reader(ops, ino, r.fh, old)
    await ops.write(w.fh, len(new), b"Z" * 10)                # continues from the writer's bytes
    assert await read_all(ops, w.fh, len(new) + 10) == new + b"Z" * 10
    await ops.release(w.fh)
    assert (await ops.getattr(ino, CTX)).st_size == len(new) + 10
    await check_old_reader(ops, ino, r.fh, old)
    await ops.release(r.fh)
    assert ino not in ops.store.ns.orphans
