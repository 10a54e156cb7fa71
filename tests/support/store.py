"""Store test helpers: real tiers (tmpfs, a directory on disk, a volume file), real LMDB."""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import trio
import xxhash

from kvfs.blockformat import build_header
from kvfs.build import build_kvstore, build_store  # noqa: E402
from kvfs.config import Config  # noqa: E402
from kvfs.store.index import Index  # noqa: E402
from kvfs.store.namespace import Namespace
from kvfs.store.nvme import NvmeTier  # noqa: E402
from kvfs.errors import NoSuchObject, TierFull
from kvfs.store import checksum
from kvfs.store.ram import RamTier
from kvfs.store.tier import ObjectInfo  # noqa: E402


@contextlib.asynccontextmanager
async def open_store(tmp: Path, *, ram: int = 4 << 20, nvme: int = 16 << 20, chunk: int = 64 << 10,
                     extra_tiers=(), high=0.9, low=0.6, admit_after: int | dict = 1,
                     clean: bool = False):
    """A Store over real tiers, without the kernel. Yields the Store. ``clean``: close as a
    clean unmount does (write-down, then the clean-unmount marker); otherwise the next
    open recovers as after a crash. ``admit_after``: as in the config (uses before a lower
    tier takes an object)."""
    index = Index(tmp / "state")
    tiers = [RamTier(ram, "/dev/shm", index.instance_id), NvmeTier(nvme, tmp / "nvme"), *extra_tiers]
    for t in tiers:
        await t.open()
    cfg = Config(chunk_size=chunk, high_watermark=high, low_watermark=low, admit_after=admit_after)
    kvstore = build_kvstore(cfg, index, tiers)
    store = kvstore.store
    kvstore.recovered = await kvstore.start()
    try:
        yield kvstore
    finally:
        store.flush_stats()
        if clean:
            await store.mover.write_down_volatile()
            kvstore.mark_clean()
        for t in tiers:
            await t.close()
        index.close()


@contextlib.asynccontextmanager
async def open_parts(tmp: Path, *, ram: int = 4 << 20, nvme: int = 16 << 20, chunk: int = 64 << 10):
    """The collaborators ``Store`` gives its members, without a Store: a real LMDB index, an
    object store over real tiers (tmpfs, a directory on disk) and the namespace over them,
    started as a fresh store is. Yields ``(index, store, ns, spill_dir)``; a member test builds
    the member (and the other members it is given) from them."""
    index = Index(tmp / "state")
    tiers = [RamTier(ram, "/dev/shm", index.instance_id), NvmeTier(nvme, tmp / "nvme")]
    for t in tiers:
        await t.open()
    store = build_store(Config(chunk_size=chunk), index, tiers)
    store.ram.overflow = tiers[1].staging_dir
    ns = Namespace(index, store)
    ns.recover(store.load())
    try:
        yield index, store, ns, tiers[1].staging_dir
    finally:
        store.flush_stats()
        for t in tiers:
            await t.close()
        index.close()


async def ram_tier(tmp: Path):
    t = RamTier(8 << 20, "/dev/shm", uuid.uuid4().hex)
    await t.open()
    return t


async def nvme_tier(tmp: Path):
    t = NvmeTier(8 << 20, tmp / "nvme")
    await t.open()
    return t


async def file_remote_tier(tmp: Path):
    """The remote tier's object store over the block-device transport on a regular file."""
    from kvfs.remote import make_volume
    from kvfs.remote.tier import RemoteTier
    img = tmp / "volume.img"
    iid = uuid.uuid4().hex
    vol = make_volume(str(img), instance_id=iid, create_size=64 << 20)
    t = RemoteTier(vol, instance_id=iid, size="100%", format=True, describe=str(img))
    await t.open()
    return t




def info(oid: int, data: bytes, key: str = "") -> ObjectInfo:
    whole, sums = checksum.summarize(memoryview(data), 1 << 16)
    return ObjectInfo(oid, len(data), whole, 1 << 16, sums, key or f"/k/{oid}", 1)


async def contract(tier) -> None:
    blobs = {oid: os.urandom(n) for oid, n in ((1, 1), (2, 4095), (3, 4096), (4, 70_001), (5, 1 << 20))}
    locs = {}
    used0 = tier.used
    for oid, data in blobs.items():
        locs[oid] = await tier.put(info(oid, data), memoryview(data))
    assert tier.used >= used0 + sum(len(d) for d in blobs.values())
    assert tier.objects >= len(blobs)
    # whole reads, partial reads at odd offsets, reads past the end are short
    for oid, data in blobs.items():
        assert bytes(await tier.read(oid, locs[oid], 0, len(data))) == data
        for off in (0, 1, len(data) // 3, max(0, len(data) - 7)):
            assert bytes(await tier.read(oid, locs[oid], off, 4099)) == data[off:off + 4099]
        assert bytes(await tier.read(oid, locs[oid], len(data) - 1, 100)) == data[-1:]
    scanned = {oid: size async for oid, _, size in tier.scan()}
    for oid, data in blobs.items():
        assert scanned.get(oid) == len(data)
    # delete frees space; reads of deleted objects fail; double delete is fine
    before = tier.used
    await tier.delete(3, locs[3])
    await tier.delete(3, locs[3])
    assert tier.used < before
    try:
        await tier.read(3, locs[3], 0, 10)
        raise AssertionError("a deleted object was readable")
    except NoSuchObject:
        pass
    # freed space is reusable and does not disturb other objects
    again = os.urandom(4096)
    loc = await tier.put(info(6, again), memoryview(again))
    assert bytes(await tier.read(6, loc, 0, 4096)) == again
    assert bytes(await tier.read(5, locs[5], 0, 1 << 20)) == blobs[5]
    # an object larger than the free space is refused with TierFull
    huge = tier.free() + 1
    try:
        await tier.put(ObjectInfo(7, huge, 0, 1 << 16, (), "/huge", 1), memoryview(bytearray(huge)))
        raise AssertionError("an object larger than the free space was accepted")
    except TierFull:
        pass
    for oid in (1, 2, 4, 5):
        await tier.delete(oid, locs[oid])
    await tier.delete(6, loc)
    assert tier.used == used0


INFO_CHUNK = 1 << 20


def make_info(oid: int, data: bytes, key: str = "", gen: int = 0) -> ObjectInfo:
    sums = tuple(xxhash.xxh3_64_intdigest(data[i:i + INFO_CHUNK]) for i in range(0, max(len(data), 1), INFO_CHUNK))
    return ObjectInfo(oid=oid, size=len(data), checksum=xxhash.xxh3_64_intdigest(data), chunk_size=INFO_CHUNK,
                      chunk_sums=sums, key=key or f"/model/blk/{oid:08x}.bin", generation=gen)


PAYLOAD = 60_000


def block(ns: str, h: str, parent: str, tokens: int) -> bytes:
    meta = {"format": "kvfs-block-v1", "kvfs.namespace": ns, "kvfs.hash": h, "kvfs.parent": parent,
            "kvfs.tokens": str(tokens), "kvfs.block_tokens": "16"}
    return build_header(meta, {"kv": ("U8", [PAYLOAD], PAYLOAD)}) + os.urandom(PAYLOAD)


def hx(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


async def write_file(kvstore, parent: int, name: bytes, data: bytes) -> int:
    fh, ino, _ = await kvstore.files.create(parent, name, 0o644, 0, 0)
    await kvstore.files.write(fh, 0, data)
    await kvstore.files.release(fh)
    return ino


async def read_file(kvstore, parent: int, name: bytes) -> bytes:
    fh = await kvstore.files.open(kvstore.ns.lookup(parent, name), os.O_RDONLY)
    try:
        return bytes(await kvstore.files.read(fh, 0, 1 << 20))
    finally:
        await kvstore.files.release(fh)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "40m"):
    """A tmpfs of ``size`` at ``path`` (sticky, world-writable like /dev/shm, huge pages as the
    daemon's own, so the tier uses it as is)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777,huge=within_size", "kvfs-test", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def plant_record(state: Path, db: bytes, key: bytes, value: bytes) -> None:
    """Write a raw value into the index of the state directory ``state`` (as an attacker
    with write access to it would, or a damaged disk)."""
    import lmdb
    env = lmdb.open(str(state / "index.lmdb"), max_dbs=8, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(db, txn=txn))
    finally:
        env.close()
