"""Issue 34 (1): an NVMe object's own record is not bounded by the filesystem's xattr cap.

Before, every record went into the ``user.kvfs.object`` xattr: ext4 (this machine's /tmp)
refuses a value over ~4 KiB with ENOSPC, which the tier read as a full disk (TierFull),
and the Linux VFS refuses one over 64 KiB (E2BIG) on every filesystem. Records that big
now go to an ``<id>.rec`` side file; small ones stay in the xattr (the old format).
"""
from __future__ import annotations

import os

import trio

from kvfs.store import checksum, nvmerecord
from kvfs.store.nvme import NvmeTier
from kvfs.store.tier import ObjectInfo

MiB = 1 << 20


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


def test_big_records_go_to_a_side_file_and_read_back(tmp_path):
    async def main():
        tier = NvmeTier(256 * MiB, tmp_path / "nvme")
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
