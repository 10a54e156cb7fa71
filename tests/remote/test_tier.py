"""RemoteTier on the real target (and on a file / loop device for the kernel transport)."""
from __future__ import annotations

import os
import random
import subprocess

import pytest
import trio
import xxhash

from kvfs.build import build_remote_tier
from kvfs.config import Config
from kvfs.errors import ConfigError, NoSuchObject, TierFull, TierUnavailable
from support.store import make_info
from support.target import open_tier

CHUNK = 1 << 20


async def put_many(tier, rnd: random.Random, n: int, first_oid: int = 1, max_size: int = 3 << 20):
    objs = {}
    for oid in range(first_oid, first_oid + n):
        data = rnd.randbytes(rnd.choice([0, 1, 511, 4096, 4097, rnd.randrange(1, max_size)]))
        objs[oid] = (await tier.put(make_info(oid, data), memoryview(data)), data)
    return objs


async def check_all(tier, objs, rnd: random.Random):
    for oid, (loc, data) in objs.items():
        assert bytes(await tier.read(oid, loc, 0, len(data) + 4096)) == data
        if len(data) > 10:
            off = rnd.randrange(len(data))
            ln = rnd.randrange(1, len(data) - off + 1)
            assert bytes(await tier.read(oid, loc, off, ln)) == data[off:off + ln]


async def exercise(tier, reopen):
    """The tier-level contract on any transport: put/read/partial reads/delete/reopen/scan."""
    rnd = random.Random(1)
    assert tier.name == "remote" and not tier.volatile and tier.available
    objs = await put_many(tier, rnd, 30)
    await check_all(tier, objs, rnd)
    used = tier.used
    assert sum(-(-len(d) // 4096) * 4096 for _, d in objs.values()) < used <= sum(
        tier.footprint(len(d)) for _, d in objs.values())
    assert all(tier.footprint(len(d)) >= len(d) for _, d in objs.values())
    for oid in list(objs)[::3]:
        loc, _ = objs.pop(oid)
        await tier.delete(oid, loc)
        await tier.delete(oid, loc)                 # deleting twice is not an error
        with pytest.raises(NoSuchObject):
            await tier.read(oid, loc, 0, 1)
    assert tier.objects == len(objs) and tier.used < used
    scanned = {oid: (loc, size) async for oid, loc, size in tier.scan()}
    assert scanned == {oid: (loc, len(d)) for oid, (loc, d) in objs.items()}
    recs = {info.oid: (info, loc) async for info, loc in tier.scan_records()}
    for oid, (loc, data) in objs.items():
        info, rloc = recs[oid]
        assert rloc == loc and info == make_info(oid, data)
    tier2 = await reopen()
    try:
        assert tier2.objects == len(objs) and tier2.used == tier.used and tier2.capacity == tier.capacity
        await check_all(tier2, objs, rnd)
        more = await put_many(tier2, rnd, 10, first_oid=1000)
        await check_all(tier2, more, rnd)
        for oid, (loc, data) in objs.items():      # freed space was reused without clobbering
            assert bytes(await tier2.read(oid, loc, 0, len(data))) == data
    finally:
        await tier2.close()


@pytest.mark.target
async def test_tier_contract_on_target(remote_url):
    tier = await open_tier(remote_url, instance_id="contract")
    try:
        await exercise(tier, lambda: open_tier(remote_url, instance_id="contract", fmt=False))
    finally:
        await tier.close()


async def test_tier_contract_on_file(tmp_path):
    cfg = Config(remote=str(tmp_path / "volume.img"), remote_size="64MiB")
    tier = build_remote_tier(cfg, "file-inst")
    await tier.open()
    try:
        await exercise(tier, lambda: _reopen(cfg, "file-inst"))
    finally:
        await tier.close()


async def _reopen(cfg, iid):
    t = build_remote_tier(cfg, iid)
    await t.open()
    return t


@pytest.fixture
def loop_device(tmp_path):
    img = tmp_path / "loop.img"
    img.write_bytes(b"")
    os.truncate(img, 64 << 20)
    dev = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True, check=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)


async def test_tier_on_loop_block_device(loop_device):
    cfg = Config(remote=loop_device, remote_size="50%")
    tier = build_remote_tier(cfg, "loop-inst")
    await tier.open()
    try:
        assert tier.vol.is_blockdev and tier.vol.direct
        assert tier.capacity < 32 << 20
        await exercise(tier, lambda: _reopen(cfg, "loop-inst"))
    finally:
        await tier.close()


@pytest.mark.target
async def test_foreign_volume_is_refused_unless_formatted(remote_url):
    tier = await open_tier(remote_url, instance_id="owner-a")
    data = b"x" * 5000
    await tier.put(make_info(1, data), memoryview(data))
    await tier.close()
    with pytest.raises(ConfigError, match="belongs to kvfs instance 'owner-a'"):
        await open_tier(remote_url, instance_id="owner-b", fmt=False)
    t = await open_tier(remote_url, instance_id="owner-b", fmt=True)
    try:
        assert t.objects == 0 and t.sb.owner == "owner-b"
    finally:
        await t.close()
    cfg = Config(remote=remote_url + "?queues=0")
    with pytest.raises(ConfigError, match="queues"):
        build_remote_tier(cfg, "x")
    with pytest.raises(ConfigError, match="nvme-tcp://"):
        build_remote_tier(Config(remote="iscsi://host/x"), "x")


async def test_not_a_kvfs_volume_and_full(tmp_path):
    img = tmp_path / "junk.img"
    img.write_bytes(b"garbage!" * 1024 + bytes((8 << 20) - 8192))
    with pytest.raises(ConfigError, match="not a kvfs volume"):
        await _reopen(Config(remote=str(img), remote_size="8MiB"), "i")
    tier = await _reopen(Config(remote=str(img), remote_size="8MiB", remote_format=True), "i")
    try:
        rnd = random.Random(5)
        blob = rnd.randbytes(1 << 20)
        locs = []
        with pytest.raises(TierFull):
            for oid in range(1, 100):
                locs.append((oid, await tier.put(make_info(oid, blob), memoryview(blob))))
        assert 3 <= len(locs) < 8 and tier.free() < tier.footprint(len(blob))
        oid, loc = locs.pop(0)
        await tier.delete(oid, loc)
        loc = await tier.put(make_info(500, blob), memoryview(blob))      # the freed space is reused
        assert bytes(await tier.read(500, loc, 0, len(blob))) == blob
    finally:
        await tier.close()
    with pytest.raises(TierUnavailable):
        await tier.read(500, loc, 0, 10)


@pytest.mark.target
@pytest.mark.slow
@pytest.mark.parametrize("query", ["", "?digest=header,data&queues=4"])
async def test_integrity_1gib_random_objects(nvmet_target, query):
    """1 GiB of random objects through the tier, read back and verified by checksum."""
    tier = await open_tier(nvmet_target.url + query, size="100%")
    try:
        rnd = random.Random(42)
        total, objs, oid = 0, {}, 0
        while total < 1 << 30:
            oid += 1
            data = os.urandom(rnd.randrange(256 << 10, 8 << 20))
            info = make_info(oid, data)
            try:
                loc = await tier.put(info, memoryview(data))
            except TierFull:
                break
            objs[oid] = (loc, info.checksum, len(data))
            total += len(data)
        assert total > 900 << 20
        for oid, (loc, ck, size) in objs.items():
            assert xxhash.xxh3_64_intdigest(bytes(await tier.read(oid, loc, 0, size))) == ck
    finally:
        await tier.close()
