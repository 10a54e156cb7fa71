"""Robustness of the moves between tiers: an empty object's demotion leaves no file behind,
and a tier whose filesystem fails writes (EROFS on a read-only tmpfs) neither crashes the
store nor loses or corrupts what stays in RAM. Real tiers, real LMDB, no kernel."""
from __future__ import annotations

import os
import stat
import subprocess

import pytest

from kvfs.errors import TierWriteFailed
from kvfs.store.index import Index, ROOT_INO
from support.store import open_store, read_file as read, write_file as write


async def test_demoting_an_empty_object_writes_no_nvme_file(tmp_path):
    async with open_store(tmp_path) as kvstore:
        d, _ = kvstore.ns.make(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
        for i, size in enumerate((0, 5000, 0, 70000)):
            await write(kvstore, d, b"f%d" % i, os.urandom(size))
            await kvstore.store.mover.demote(kvstore.ns.sealed[kvstore.ns.lookup(d, b"f%d" % i)], 0)
        nvme = kvstore.store.tiers[1]
        running = (nvme.used, nvme.objects)
        files = [oid async for oid, _, _ in nvme.scan()]
        assert running[1] == len(files) == 2
        assert await kvstore.sweep_orphans() == 0
    Index(tmp_path / "state").close()
    async with open_store(tmp_path) as kvstore:          # a full load counts from the records
        nvme = kvstore.store.tiers[1]
        assert (nvme.used, nvme.objects) == running
        d = kvstore.ns.lookup(ROOT_INO, b"d")
        assert await read(kvstore, d, b"f0") == b"" and await read(kvstore, d, b"f2") == b""


async def test_failed_nvme_writes_leave_objects_in_ram_through_relief_and_write_down(tmp_path):
    async with open_store(tmp_path, ram=1 << 20) as kvstore:
        shards = sorted((tmp_path / "nvme" / "objects").iterdir())
        d, _ = kvstore.ns.make(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
        want = {b"f%d" % i: os.urandom(60000) for i in range(16)}      # above the high watermark
        subprocess.run(["chattr", "+i", *map(str, shards)], check=True)
        try:
            for name, data in want.items():
                await write(kvstore, d, name, data)
            store = kvstore.store
            await store.mover.relieve()                       # EPERM on the first victim: it stays
            with pytest.raises(TierWriteFailed):        # a direct move says why it did not happen
                await store.mover.demote(kvstore.ns.sealed[kvstore.ns.lookup(d, b"f0")], 0)
            assert await store.mover.write_down_volatile() == len(want)   # all lost, none raised
            c = store.counters["nvme"]
            assert c.errors == 2 + len(want) and store.tiers[1].objects == 0
            assert all(set(o.place) == {"ram"} for o in store.objs.values() if o.size)
            for name, data in want.items():
                assert await read(kvstore, d, name) == data
        finally:
            subprocess.run(["chattr", "-i", *map(str, shards)], check=True)
        await kvstore.store.mover.relieve()                     # the directory takes writes again
        assert kvstore.store.tiers[1].objects > 0
        for name, data in want.items():
            assert await read(kvstore, d, name) == data
