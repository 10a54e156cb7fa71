"""A read of a file's current version never pads it with zeros where its bytes exist, and a
write buffer whose write failed can be truncated to 0 and sealed (review of issue 32)."""
from __future__ import annotations

import os

import pytest

from kvfs.store.index import ROOT_INO
from support.store import open_store, small_tmpfs

KiB, MiB = 1 << 10, 1 << 20


async def _two_writers(kvstore, head: bytes, how: str):
    """A file holding ``head``, open twice for writing; its content a spilled buffer
    (``spilled``) or its sealed object (``sealed``: the handles read ``ws.base``)."""
    fh, ino, _ = await kvstore.files.create(ROOT_INO, b"f", 0o644, 0, 0, os.O_RDWR)
    await kvstore.files.write(fh, 0, head)
    if how == "sealed":
        await kvstore.files.flush(fh)
    fh2 = await kvstore.files.open(ino, os.O_WRONLY)
    ws = kvstore.files.handles[fh].ws
    if how == "spilled":
        await ws.staging.spill(kvstore.spill_dir)
        assert ws.staging.spilled
    else:
        assert ws.staging is None and ws.base is not None
    return fh, fh2


@pytest.mark.parametrize("how", ["spilled", "sealed"])
async def test_a_read_racing_a_write_that_extends_the_current_version(tmp_path, how):
    """The race of a read (its bytes fetched at size S, in a worker thread) with a write through
    another descriptor extending the file to S+W, taken step by step as the daemon interleaves
    it: the reader gets the file's real bytes, never W zeros (kvfs/store/files.py _fitted)."""
    async with open_store(tmp_path) as kvstore:
        head, tail = os.urandom(256 * KiB), os.urandom(128 * KiB)
        fh, fh2 = await _two_writers(kvstore, head, how)
        h = kvstore.files.handles[fh]
        data, n = await kvstore.files._content(h, 0, MiB)        # the bytes, before the await returns
        assert bytes(data) == head and n == len(head)
        await kvstore.files.write(fh2, len(head), tail)           # meanwhile, through the other fd
        got = await kvstore.files._fitted(h, 0, MiB, data, n)     # then fitted to the size now
        assert bytes(got) == head + tail
        assert bytes(await kvstore.files.read(fh, 0, MiB)) == head + tail
        await kvstore.files.release(fh2)
        await kvstore.files.release(fh)


async def test_an_older_version_is_still_padded_to_the_current_size(tmp_path):
    """A reader of the sealed version a new buffer replaced reads zeros past its end (docs/design.md,
    "Versions and sizes"): only the current version is never padded."""
    async with open_store(tmp_path) as kvstore:
        head, tail = os.urandom(64 * KiB), os.urandom(32 * KiB)
        fh, ino, _ = await kvstore.files.create(ROOT_INO, b"f", 0o644, 0, 0, os.O_WRONLY)
        await kvstore.files.write(fh, 0, head)
        await kvstore.files.release(fh)
        rd = await kvstore.files.open(ino, os.O_RDONLY)
        wr = await kvstore.files.open(ino, os.O_WRONLY)
        await kvstore.files.write(wr, len(head), tail)
        assert bytes(await kvstore.files.read(rd, 0, MiB)) == head + bytes(len(tail))
        await kvstore.files.release(wr)
        await kvstore.files.release(rd)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")
@pytest.mark.parametrize("how", ["truncate", "O_TRUNC"])
async def test_a_failed_buffer_truncated_to_zero_seals_again(tmp_path, how):
    """After a write failed (ENOSPC: the buffer lacks bytes, so it must not be sealed), a
    truncate to 0 (truncate(2), or an O_TRUNC open joining the writers) rewrites the whole
    buffer: the file seals again."""
    with small_tmpfs(tmp_path / "nvme", "8m"):
        async with open_store(tmp_path, ram=2 * MiB, nvme=64 * MiB) as kvstore:
            fh, ino, _ = await kvstore.files.create(ROOT_INO, b"f", 0o644, 0, 0, os.O_RDWR)
            with pytest.raises(OSError):
                for i in range(32):                       # past RAM: spilled, then the disk is full
                    await kvstore.files.write(fh, i * MiB, os.urandom(MiB))
            assert kvstore.files.handles[fh].ws.failed
            other = None
            if how == "truncate":
                await kvstore.files.setattr(ino, size=0)
            else:
                other = await kvstore.files.open(ino, os.O_WRONLY | os.O_TRUNC)
                await kvstore.files.release(other)
            data = os.urandom(100 * KiB)
            await kvstore.files.write(fh, 0, data)
            await kvstore.files.flush(fh)                         # seals (TierFull before the fix)
            await kvstore.files.release(fh)
            rd = await kvstore.files.open(ino, os.O_RDONLY)
            assert bytes(await kvstore.files.read(rd, 0, MiB)) == data
            await kvstore.files.release(rd)
