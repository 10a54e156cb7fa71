"""A start after a crash (no clean-unmount marker) with the running totals of kvfs.store.tally:
it drops exactly the files never sealed and those whose only copy was in RAM, decodes only
the records its two sets name, and starts with the totals a full recovery (every record
decoded) computes. Real tiers, real LMDB, no kernel: the "crash" is closing without the
clean unmount (nothing written down, no marker), so the index holds what the group commits
wrote."""
from __future__ import annotations

import os
import stat
import struct

import trio

from kvfs.build import fsck_layout
from kvfs.config import Config
from kvfs.store import tally
from kvfs.store.fsck import run_fsck
from kvfs.store.index import Index, ROOT_INO
from support.store import open_store, read_file as read, write_file as write

FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


def totals(kvstore) -> tuple:
    nvme = kvstore.store.tiers[1]
    return nvme.used, nvme.objects, len(kvstore.store.objs), kvstore.telemetry.totals()


async def _build(kvstore) -> dict[tuple[bytes, bytes], bytes]:
    """Files in two namespaces: durable ones, RAM-only ones, unsealed ones, renamed, replaced
    and removed ones; returns the durable files' contents by (namespace, name)."""
    a, _ = kvstore.ns.make(ROOT_INO, b"a", DIR, 0, 0)
    b, _ = kvstore.ns.make(ROOT_INO, b"b", DIR, 0, 0)
    durable = {}
    for i in range(30):
        ns, d = (b"a", a) if i % 2 else (b"b", b)
        data = os.urandom(100 + i * 1111)
        await write(kvstore, d, b"f%d" % i, data)
        await kvstore.store.mover.demote(kvstore.ns.sealed[kvstore.ns.lookup(d, b"f%d" % i)], 0)
        durable[(ns, b"f%d" % i)] = data
    await kvstore.names.rename(a, b"f1", b, b"moved", 0)              # into another namespace
    durable[(b"b", b"moved")] = durable.pop((b"a", b"f1"))
    await kvstore.names.unlink(b, b"f2")
    del durable[(b"b", b"f2")]
    new = os.urandom(5000)                                      # replaced by a RAM-only version:
    await write(kvstore, a, b"f3.tmp", new)                       # the file goes with it
    await kvstore.names.rename(a, b"f3.tmp", a, b"f3", 0)
    del durable[(b"a", b"f3")]
    for i in range(5):                                          # RAM-only (never written down)
        await write(kvstore, b, b"ram%d" % i, os.urandom(3000 + i))
    for i in range(4):                                          # created, never sealed
        kvstore.ns.make(a, b"unsealed%d" % i, FILE, 0, 0, oid=None)
    fh, _, _ = await kvstore.files.create(b, b"open", 0o644, 0, 0)     # being written at the "crash"
    await kvstore.files.write(fh, 0, b"x" * 1000)
    return durable


async def test_a_crash_start_drops_exactly_the_sets_and_keeps_exact_totals(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
        durable = await _build(kvstore)
        kvstore.index.commit()
    async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
        got = kvstore.recovered
        fast = totals(kvstore)
        assert got["dropped_files"] == 5 + 4 + 1 + 1 and got["lost_objects"] == 5 + 1
        assert got["decoded"] <= 3 * (got["dropped_files"] + got["lost_objects"])   # the sets only
        assert not kvstore.store.table_loaded and dict.__len__(kvstore.store.objs) == 0
        for ns in (b"a", b"b"):
            d = kvstore.ns.lookup(ROOT_INO, ns)
            names = {n for _e, n, _i, _r in kvstore.names.entries(d, 0)}
            assert names == {n for (s, n) in durable if s == ns}
        for (ns, name), data in durable.items():
            assert await read(kvstore, kvstore.ns.lookup(ROOT_INO, ns), name) == data
        await kvstore.store.wait_loaded()
    ix = Index(tmp_path / "state")
    tally.invalidate(ix)
    ix.close()
    async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
        assert kvstore.store.table_loaded and kvstore.recovered["decoded"] >= 2 * len(durable)
        assert not kvstore.recovered["dropped_files"] and not kvstore.recovered["lost_objects"]
        assert totals(kvstore) == fast                           # the full recount agrees


async def test_totals_stay_exact_across_repeated_crashes_and_a_clean_unmount(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
        await _build(kvstore)
        kvstore.index.commit()
    for round_ in range(3):
        async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20, clean=round_ == 1) as kvstore:
            a = kvstore.ns.lookup(ROOT_INO, b"a")
            await write(kvstore, a, b"r%d" % round_, os.urandom(2000))    # RAM-only, then lost
            await write(kvstore, a, b"w%d" % round_, os.urandom(4000))
            await kvstore.store.mover.demote(kvstore.ns.sealed[kvstore.ns.lookup(a, b"w%d" % round_)], 0)
            if round_ == 0:
                await kvstore.names.unlink(a, b"f5")
            kvstore.index.commit()
            seen = totals(kvstore)
    async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
        fast = totals(kvstore)
    assert fast[2] <= seen[2]
    ix = Index(tmp_path / "state")
    tally.invalidate(ix)
    ix.close()
    async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
        assert kvstore.store.table_loaded
        assert totals(kvstore) == fast


def test_fsck_checks_the_sets_and_totals_against_the_records(tmp_path):
    async def build():
        async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
            await _build(kvstore)
            kvstore.index.commit()
        async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
            assert kvstore.recovered["lost_objects"]      # the crash start, then a clean unmount
        async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20, clean=True):
            pass
    trio.run(build)
    cfg = Config(nvme=str(tmp_path / "nvme"), state=str(tmp_path / "state"), nvme_size="8MiB")
    assert run_fsck(fsck_layout(cfg)).problems == []
    ix = Index(tmp_path / "state")                   # a total that drifted from the records
    with ix.write() as txn:
        txn.recover_set(tally.NAMESPACE + b"a", struct.pack(">qq", 1, 1))
    ix.close()
    report = run_fsck(fsck_layout(cfg), repair=True)
    assert len(report.problems) == 1 and "running total b'na'" in report.problems[0]
    assert run_fsck(fsck_layout(cfg)).problems == []             # forgotten: the next start recounts

    async def start():
        async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
            assert kvstore.store.table_loaded         # a full recovery
    trio.run(start)
    assert run_fsck(fsck_layout(cfg)).problems == []


def test_a_renewed_name_after_a_crash_is_on_the_new_inode(tmp_path):
    """A held file's renewal (kvfs/store/namespace.py ``renew``) is one index transaction: a
    start after a crash (the reader never closed) finds the name on the new inode with its
    bytes and the old inode gone, and a renewed file whose only copy was in RAM gone with its
    name, by the fast recovery and by a full one alike; fsck agrees."""
    data, seen = os.urandom(300_000), {}

    async def crash():
        async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
            ino = await write(kvstore, ROOT_INO, b"f", data)
            await kvstore.store.mover.demote(kvstore.ns.sealed[ino], 0)
            await kvstore.files.open(ino, os.O_RDONLY)       # the passthrough reader
            seen["old"], seen["new"] = ino, kvstore.names.renew(ino)[2]
            ram = await write(kvstore, ROOT_INO, b"ram", b"r" * 5000)     # only in RAM: lost
            await kvstore.files.open(ram, os.O_RDONLY)
            assert kvstore.names.renew(ram) is not None
            kvstore.index.commit()

    async def start(full: bool):
        if full:
            ix = Index(tmp_path / "state")
            tally.invalidate(ix)
            ix.close()
        async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
            assert kvstore.store.table_loaded == full
            assert kvstore.ns.lookup(ROOT_INO, b"f") == seen["new"]
            assert kvstore.index.get_inode(seen["old"]) is None
            assert await read(kvstore, ROOT_INO, b"f") == data
            obj = kvstore.ns.sealed[seen["new"]]
            assert obj.ino == seen["new"] and not obj.dead
            # the RAM-only file's object record names its new inode: the name goes with it
            assert kvstore.ns.find(ROOT_INO, b"ram") is None
    trio.run(crash)
    trio.run(start, False)
    trio.run(start, True)
    cfg = Config(nvme=str(tmp_path / "nvme"), state=str(tmp_path / "state"), nvme_size="8MiB")
    assert run_fsck(fsck_layout(cfg)).problems == []
