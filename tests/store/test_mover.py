"""The mover (kvfs/store/moves.py): demotion, promotion, eviction, making room and relief the
way the policy says, and the clean unmount's write-down. Real tiers (tmpfs, a directory),
real LMDB, no kernel."""
from __future__ import annotations

import os

from kvfs.store.index import ROOT_INO
from support.store import open_store, read_file, write_file

KiB = 1 << 10


async def put(kvstore, name: bytes, data: bytes):
    return kvstore.ns.sealed[await write_file(kvstore, ROOT_INO, name, data)]


def placed(kvstore, obj) -> set[str]:
    """Where the index says ``obj`` lives (durable copies only)."""
    return set(kvstore.index.get_object(obj.oid).place)


async def test_demote_copies_down_and_frees_the_copy_above(tmp_path):
    async with open_store(tmp_path) as kvstore:
        store, mover = kvstore.store, kvstore.store.mover
        ram, nvme = store.tiers
        data = os.urandom(200 * KiB)
        obj = await put(kvstore, b"f", data)
        used = ram.used
        await mover.demote(obj, 0)
        assert set(obj.place) == {"nvme"} and placed(kvstore, obj) == {"nvme"} and not obj.busy
        assert ram.used == used - ram.footprint(len(data)) and nvme.objects == 1
        assert obj.oid in store.lru["nvme"] and obj.oid not in store.lru["ram"]
        assert store.counters["ram"].demotions == 1 and store.counters["nvme"].bytes_written == len(data)
        assert store.events.statistics()["emitted"].get("demoted") == 1
        assert await read_file(kvstore, ROOT_INO, b"f") == data


async def test_a_demotion_keeps_the_copy_a_reader_holds(tmp_path):
    async with open_store(tmp_path) as kvstore:
        mover = kvstore.store.mover
        obj = await put(kvstore, b"f", os.urandom(100 * KiB))
        obj.refs = 1
        await mover.demote(obj, 0)
        assert set(obj.place) == placed(kvstore, obj) == {"ram", "nvme"}     # both recorded
        obj.refs = 0
        await mover.demote(obj, 0)                  # the copy below is there: only RAM's goes
        assert set(obj.place) == placed(kvstore, obj) == {"nvme"}
        assert kvstore.store.counters["nvme"].bytes_written == 100 * KiB


async def test_promote_copies_up_and_keeps_the_lower_copy(tmp_path):
    async with open_store(tmp_path) as kvstore:
        store, mover = kvstore.store, kvstore.store.mover
        data = os.urandom(150 * KiB)
        obj = await put(kvstore, b"f", data)
        await mover.demote(obj, 0)
        await mover.promote(obj)
        assert set(obj.place) == {"ram", "nvme"} and obj.oid in store.lru["ram"]
        assert placed(kvstore, obj) == {"nvme"}          # a promotion writes no record
        assert store.counters["nvme"].promotions == 1
        await mover.promote(obj)                        # in RAM already: the policy says no
        assert store.counters["nvme"].promotions == 1
        assert await read_file(kvstore, ROOT_INO, b"f") == data


async def test_evict_drops_the_object_and_its_name(tmp_path):
    async with open_store(tmp_path) as kvstore:
        store, mover = kvstore.store, kvstore.store.mover
        obj = await put(kvstore, b"f", os.urandom(64 * KiB))
        await mover.demote(obj, 0)
        await mover.promote(obj)
        await mover.evict(obj)
        assert obj.dead and kvstore.index.lookup(ROOT_INO, b"f") is None
        assert kvstore.index.get_object(obj.oid) is None
        assert store.counters["ram"].evictions == store.counters["nvme"].evictions == 1
        assert store.tiers[0].objects == store.tiers[1].objects == 0


async def test_make_room_demotes_from_ram_and_evicts_from_the_lowest_tier(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, nvme=1 << 20) as kvstore:
        store, mover = kvstore.store, kvstore.store.mover
        ram, nvme = store.tiers
        size = 192 * KiB
        objs = [await put(kvstore, b"f%d" % i, os.urandom(size)) for i in range(4)]
        await mover.make_room(0, ram.free() + 2 * size)     # the two oldest leave RAM
        assert [set(o.place) for o in objs] == [{"nvme"}, {"nvme"}, {"ram"}, {"ram"}]
        assert store.counters["ram"].demotions == 2 and store.counters["ram"].evictions == 0
        await mover.make_room(1, nvme.free() + size)         # NVMe is the lowest: its oldest goes
        assert objs[0].dead and kvstore.index.lookup(ROOT_INO, b"f0") is None
        assert not objs[1].dead and store.counters["nvme"].evictions == 1


async def test_an_object_the_tier_below_does_not_admit_is_evicted_instead(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, admit_after={"nvme": 2}) as kvstore:
        store, mover = kvstore.store, kvstore.store.mover
        once = await put(kvstore, b"once", os.urandom(128 * KiB))
        twice = await put(kvstore, b"twice", os.urandom(128 * KiB))
        store.note_open(twice)
        await mover.make_room(0, store.ram.free() + 256 * KiB)
        assert once.dead and set(twice.place) == {"nvme"}
        assert store.counters["ram"].evictions == 1 and store.telemetry.admission_dropped == {"nvme": 1}


async def test_relieve_brings_a_tier_over_its_high_watermark_down_to_its_low_one(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, high=0.9, low=0.5) as kvstore:
        store, mover = kvstore.store, kvstore.store.mover
        ram = store.ram
        files = {}
        while ram.used <= 0.9 * ram.capacity:
            name, data = b"f%d" % len(files), os.urandom(96 * KiB)
            await put(kvstore, name, data)
            files[name] = data
            assert len(files) < 20
        await mover.relieve()
        assert ram.used <= 0.5 * ram.capacity and not store.policy.pressed()
        assert store.counters["ram"].evictions == 0
        for name, data in files.items():
            assert await read_file(kvstore, ROOT_INO, name) == data


async def test_write_down_keeps_ram_only_objects_and_counts_what_it_cannot(tmp_path):
    async with open_store(tmp_path, ram=2 << 20, nvme=512 * KiB) as kvstore:
        mover = kvstore.store.mover
        small = await put(kvstore, b"small", os.urandom(100 * KiB))
        big = await put(kvstore, b"big", os.urandom(600 * KiB))      # more than NVMe holds
        assert mover.unkept == 0
        assert await mover.write_down_volatile() == 2
        assert mover.unkept == 1
        assert set(small.place) == placed(kvstore, small) == {"ram", "nvme"}
        assert set(big.place) == {"ram"}
