"""Issue 34 (1): an NVMe object's own record is not bounded by the filesystem's xattr cap.

Before, every record went into the ``user.kvfs.object`` xattr: ext4 (this machine's /tmp)
refuses a value over ~4 KiB with ENOSPC, which the tier read as a full disk (TierFull),
and the Linux VFS refuses one over 64 KiB (E2BIG) on every filesystem. Records that big
now go to an ``<id>.rec`` side file; small ones stay in the xattr (the old format).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess

import pytest
import trio

from kvfs.store import checksum, nvmerecord
from kvfs.store.nvme import NvmeTier
from kvfs.store.tier import ObjectInfo

MiB = 1 << 20


@pytest.fixture
def ext4_dir(tmp_path):
    """A directory on a fresh ext4 of 1 KiB blocks (its xattr cap is 960 bytes, the smallest
    ext4 has) on a loop device, whatever filesystem holds the test's tmp_path; skipped where
    this machine cannot make or mount one (not root, no loop devices)."""
    img, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("making an ext4 image needs root and mkfs.ext4")
    with open(img, "wb") as f:
        f.truncate(160 * MiB)
    made = subprocess.run(["mkfs.ext4", "-q", "-b", "1024", str(img)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    res = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"no loop mount here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _info(oid: int, data: bytes, chunk: int, key: str) -> ObjectInfo:
    whole, sums = checksum.summarize(memoryview(data), chunk)
    return ObjectInfo(oid, len(data), whole, chunk, sums, key, 3)


async def _records(tier: NvmeTier) -> dict[int, ObjectInfo]:
    return {i.oid: i async for i, _ in tier.scan_records()}


def _has_xattr(path) -> bool:
    try:
        os.getxattr(path, nvmerecord.RECORD_XATTR)
        return True
    except OSError:
        return False


@pytest.mark.parametrize("where", ["tmp", "ext4"])
def test_big_records_go_to_a_side_file_and_read_back(tmp_path, request, where):
    base = tmp_path if where == "tmp" else request.getfixturevalue("ext4_dir")

    async def main():
        tier = NvmeTier(128 * MiB, base / "nvme")
        await tier.open()
        try:
            small = os.urandom(3 * MiB)
            mid = os.urandom(4 * MiB)            # 1,024 sums at 4 KiB: 8 KiB, over ext4's ~4 KiB
            big = os.urandom(40 * MiB)           # 10,240 sums: 80 KiB, over the VFS's 64 KiB
            objs = {1: _info(1, small, MiB, "/m/small.bin"), 2: _info(2, mid, 4096, "/m/mid.bin"),
                    3: _info(3, big, 4096, "/m/big.bin"),
                    4: _info(4, small, MiB, "/m/" + "k" * 3000 + ".bin")}     # a long key alone
            datas = {1: small, 2: mid, 3: big, 4: small}
            for oid, inf in objs.items():
                assert await tier.put(inf, memoryview(datas[oid])) == b""
            assert tier.objects == 4
            shard = {oid: tier.path(oid) for oid in objs}
            # the small record stays where it always was (an existing tier's files read the same)
            assert _has_xattr(shard[1]) and not shard[1].with_name(shard[1].name + ".rec").exists()
            for oid in (2, 3, 4):
                assert shard[oid].with_name(shard[oid].name + ".rec").exists()
            recs = await _records(tier)
            assert recs == objs
            for oid, data in datas.items():
                assert bytes(await tier.read(oid, b"", 0, len(data))) == data
            # a torn side file is refused, not trusted
            side = shard[3].with_name(shard[3].name + ".rec")
            raw = side.read_bytes()
            side.write_bytes(raw[:len(raw) // 2])
            assert 3 not in await _records(tier)
            side.write_bytes(raw)
            # deleting an object removes its side file too
            await tier.delete(3, b"")
            await tier.delete(2, b"")
            assert not side.exists() and not shard[3].exists()
            assert not shard[2].with_name(shard[2].name + ".rec").exists()
            assert set(await _records(tier)) == {1, 4}
        finally:
            await tier.close()
    trio.run(main)


def test_record_survives_a_reopen_of_the_tier(tmp_path):
    """The record of a 1 GiB object at 1 MiB chunks (8 KiB of sums), as written by a daemon,
    is what a later one (fsck's rebuild) reads back."""
    async def main():
        data = os.urandom(2 * MiB)
        whole, _ = checksum.summarize(memoryview(data), MiB)
        sums = tuple(range(1, 1025))                # the shape of a 1 GiB object's record
        inf = ObjectInfo(7, len(data), whole, MiB, sums, "/g/one-gib.bin", 1)
        tier = NvmeTier(64 * MiB, tmp_path / "nvme")
        await tier.open()
        try:
            await tier.put(inf, memoryview(data))
        finally:
            await tier.close()
        tier = NvmeTier(64 * MiB, tmp_path / "nvme")
        await tier.open()
        try:
            assert await _records(tier) == {7: inf}
        finally:
            await tier.close()
    trio.run(main)


def test_an_xattr_refused_as_too_big_is_a_side_file_not_a_full_disk(ext4_dir):
    """A record under XATTR_MAX that the filesystem still refuses (ENOSPC: here the file's
    one xattr block is taken by another name) goes to the side file."""
    shard = os.open(ext4_dir, os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open(ext4_dir / "obj.tmp", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.setxattr(fd, "user.other", b"o" * 800)
        with pytest.raises(OSError) as e:
            os.setxattr(fd, "user.probe", b"r" * 500)
        assert e.value.errno == errno.ENOSPC          # what ext4 says: not a full disk
        raw = b"r" * 500
        assert nvmerecord.store(fd, shard, "obj", raw, sync=True) == "side"
        os.rename("obj.tmp", "obj", src_dir_fd=shard, dst_dir_fd=shard)
        assert nvmerecord.load(fd, shard, "obj") == raw
        assert nvmerecord.leftovers([shard]) == []
        os.unlink("obj", dir_fd=shard)
        assert nvmerecord.leftovers([shard]) == [(shard, "obj.rec")]
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.close(shard)
