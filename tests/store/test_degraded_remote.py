"""Placement while the remote tier is unreachable: nothing that lives down there is thrown
away to make room above it. Real tiers (tmpfs, a directory, the remote object store on a
volume file), real LMDB, no kernel; "unreachable" is the volume closed under the tier."""
from __future__ import annotations

import os

from kvfs.store.index import ROOT_INO
from support.store import file_remote_tier, open_store

KiB = 1 << 10
SIZE = 192 * KiB


async def write(kvstore, name: bytes, data: bytes) -> None:
    fh, _, _ = await kvstore.files.create(ROOT_INO, name, 0o644, 0, 0)
    await kvstore.files.write(fh, 0, data)
    await kvstore.files.release(fh)
    await kvstore.store.mover.relieve()


async def read(kvstore, name: bytes) -> bytes:
    ino = kvstore.index.lookup(ROOT_INO, name)
    assert ino is not None, f"{name!r} is gone"
    fh = await kvstore.files.open(ino, os.O_RDONLY)
    try:
        return bytes(await kvstore.files.read(fh, 0, 1 << 30))
    finally:
        await kvstore.files.release(fh)


def obj_of(kvstore, name: bytes):
    return kvstore.store.objs[kvstore.index.get_inode(kvstore.index.lookup(ROOT_INO, name)).oid]


def evictions(kvstore) -> int:
    return sum(c.evictions for c in kvstore.store.counters.values())


async def fill(kvstore, n: int, prefix: str) -> dict[bytes, bytes]:
    files = {}
    for i in range(n):
        name, data = f"{prefix}{i}".encode(), os.urandom(SIZE)
        await write(kvstore, name, data)
        files[name] = data
    return files


async def test_promotion_with_the_remote_down_never_evicts(tmp_path):
    remote = await file_remote_tier(tmp_path)
    async with open_store(tmp_path, ram=1 << 20, nvme=2 << 20, extra_tiers=[remote]) as kvstore:
        store = kvstore.store
        files = await fill(kvstore, 16, "f")
        tops = {n: store.top_tier(obj_of(kvstore, n)) for n in files}
        assert set(tops.values()) == {"ram", "nvme", "remote"}
        await remote.vol.close()                       # the target is gone
        assert not remote.available
        for n in files:                                 # hot NVMe objects want to move up
            if tops[n] == "nvme":
                await store.mover.promote(obj_of(kvstore, n))
        assert evictions(kvstore) == 0
        for n, data in files.items():                  # everything above the remote still reads
            if tops[n] != "remote":
                assert await read(kvstore, n) == data
        await remote.vol.open()                         # the target is back
        for n, data in files.items():
            assert await read(kvstore, n) == data


async def test_pressure_with_the_remote_down_drops_copies_that_live_there_first(tmp_path):
    remote = await file_remote_tier(tmp_path)
    async with open_store(tmp_path, ram=1 << 20, nvme=2 << 20, extra_tiers=[remote]) as kvstore:
        store = kvstore.store
        files = await fill(kvstore, 16, "f")
        hot = next(n for n in files if store.top_tier(obj_of(kvstore, n)) == "remote")
        obj = obj_of(kvstore, hot)
        await store.mover.promote(obj)                        # RAM + remote
        assert set(obj.place) == {"ram", "remote"}
        await remote.vol.close()
        await store.mover.demote(obj, 0)                      # no remote: it is copied to NVMe
        assert set(obj.place) == {"nvme", "remote"}
        more = await fill(kvstore, 12, "g")               # new writes push NVMe to evict
        assert evictions(kvstore) > 0                     # the rule: evict from NVMe instead
        assert not obj.dead and set(obj.place) == {"remote"}   # its NVMe copy went first, not the object
        for n, data in more.items():
            if kvstore.index.lookup(ROOT_INO, n) is not None:
                assert await read(kvstore, n) == data
        await remote.vol.open()
        assert await read(kvstore, hot) == files[hot]


async def test_remote_errors_count_the_stores_and_the_transports(tmp_path):
    """The remote tier's ``errors`` in the statistics is the store's count (its reads that
    failed) plus the transport's own (the volume's failed I/O), each also reported on its
    own: reads of a volume file truncated under the tier fail in both. The transport's count
    once replaced the store's."""
    import pytest
    from kvfs.errors import TierUnavailable
    remote = await file_remote_tier(tmp_path)
    async with open_store(tmp_path, ram=1 << 20, nvme=2 << 20, extra_tiers=[remote]) as kvstore:
        store = kvstore.store
        files = await fill(kvstore, 16, "f")
        down = [n for n in files if set(obj_of(kvstore, n).place) == {"remote"}]
        assert down
        os.truncate(tmp_path / "volume.img", 0)        # short reads from now on
        for n in down[:2]:
            with pytest.raises(TierUnavailable):
                await read(kvstore, n)
        st = store.statistics()["remote"]
        assert st["store_errors"] == store.counters["remote"].errors >= 1
        assert st["transport_errors"] == remote.vol.errors >= 1
        assert st["errors"] == st["store_errors"] + st["transport_errors"]
        assert "store_errors" not in store.statistics()["nvme"]     # a tier with no errors of its own
