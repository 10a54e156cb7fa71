"""A start after a clean unmount decodes no record: objects are built on first use, the
LRU order and KV child counts are scanned in the background, tier totals come from the
clean-unmount marker. A start after a crash reads only the unsealed and RAM-only sets and
the running totals (kvfs.store.tally); one after a write behind kvfs's back, or with the
totals invalid, recovers in full. Real tiers, real LMDB, no kernel."""
from __future__ import annotations

import os
import stat

import lmdb
import trio

from kvfs.store import objtable, tally
from kvfs.store.index import Index, ROOT_INO
from support.store import open_store, block, hx, read_file as read, write_file as write

FILE = stat.S_IFREG | 0o644


def built(kvstore) -> int:
    return dict.__len__(kvstore.store.objs)


async def test_a_clean_start_builds_objects_on_first_use(tmp_path):
    want = {}
    async with open_store(tmp_path, clean=True) as kvstore:
        d, _ = kvstore.ns.make(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
        for i in range(40):
            want[b"f%d" % i] = os.urandom(i * 997)
            await write(kvstore, d, b"f%d" % i, want[b"f%d" % i])
        for i in range(1, 40, 3):          # some on NVMe only, the rest written down at close
            await kvstore.store.mover.demote(kvstore.ns.sealed[kvstore.ns.lookup(d, b"f%d" % i)], 0)
        kvstore.xattrs.set(kvstore.ns.lookup(d, b"f5"), b"user.kvfs.pin", b"1")
    ix = Index(tmp_path / "state")                    # consumes the marker and the totals: ...
    tally.invalidate(ix)
    ix.close()
    async with open_store(tmp_path) as kvstore:         # ... what a full recovery computes
        assert kvstore.store.table_loaded
        nvme = kvstore.store.tiers[1]
        full = (nvme.used, nvme.objects, len(kvstore.store.objs), kvstore.telemetry.totals())
        lru = list(kvstore.store.lru["nvme"])
        pinned = {o.oid for o in kvstore.store.objs.values() if o.pinned}
    async with open_store(tmp_path, clean=True):      # marks it clean again
        pass
    async with open_store(tmp_path) as kvstore:
        nvme = kvstore.store.tiers[1]
        assert built(kvstore) == 0 and not kvstore.store.table_loaded
        assert (nvme.used, nvme.objects, len(kvstore.store.objs), kvstore.telemetry.totals()) == full
        d = kvstore.ns.lookup(ROOT_INO, b"d")
        assert await read(kvstore, d, b"f7") == want[b"f7"]
        assert built(kvstore) == 1
        ino5 = kvstore.ns.lookup(d, b"f5")
        assert kvstore.ns.sealed[ino5].pinned and kvstore.ns.sealed[ino5].oid in pinned
        await kvstore.store.wait_loaded()
        assert kvstore.store.table_loaded and list(kvstore.store.lru["nvme"]) == lru
        for name, data in want.items():
            assert await read(kvstore, d, name) == data
        assert {o.oid for o in kvstore.store.objs.values() if o.pinned} == pinned


async def test_the_clean_start_table_follows_changes_made_before_the_scan(tmp_path):
    async with open_store(tmp_path, clean=True) as kvstore:
        for i in range(30):
            await write(kvstore, ROOT_INO, b"f%d" % i, os.urandom(3000))
    async with open_store(tmp_path, clean=True) as kvstore:
        assert not kvstore.store.table_loaded
        gone = kvstore.ns.sealed[kvstore.ns.lookup(ROOT_INO, b"f3")].oid
        await kvstore.names.unlink(ROOT_INO, b"f3")
        await kvstore.names.rename(ROOT_INO, b"f4", ROOT_INO, b"f5", 0)
        new = kvstore.ns.sealed[await write(kvstore, ROOT_INO, b"new", b"n" * 5000)].oid
        await kvstore.store.wait_loaded()
        nvme_lru = list(kvstore.store.lru["nvme"])
        assert gone not in nvme_lru and len(kvstore.store.objs) == 29
        assert len(nvme_lru) == 28 and new in kvstore.store.lru["ram"]
    async with open_store(tmp_path) as kvstore:         # the crash path agrees
        assert len(kvstore.store.objs) == 29 and kvstore.store.tiers[1].objects == 29
        assert kvstore.index.lookup(ROOT_INO, b"f4") is None and await read(kvstore, ROOT_INO, b"new") == b"n" * 5000


async def test_any_open_consumes_the_marker_and_unsealed_files_go_at_a_clean_unmount(tmp_path):
    async with open_store(tmp_path, clean=True) as kvstore:
        await write(kvstore, ROOT_INO, b"kept", b"k" * 100)
        kvstore.ns.make(ROOT_INO, b"never-sealed", FILE, 0, 0, oid=None)
    async with open_store(tmp_path) as kvstore:
        assert not kvstore.store.table_loaded                 # a clean start ...
        assert kvstore.index.lookup(ROOT_INO, b"never-sealed") is None
        kvstore.ns.make(ROOT_INO, b"unsealed", FILE, 0, 0, oid=None)
        kvstore.index.commit()                                # ... then a "crash": no marker
    async with open_store(tmp_path) as kvstore:
        assert kvstore.recovered["dropped_files"] == 1        # the unsealed set dropped it ...
        assert kvstore.recovered["decoded"] == 1 and not kvstore.store.table_loaded    # ... alone
        assert kvstore.index.lookup(ROOT_INO, b"unsealed") is None
        assert await read(kvstore, ROOT_INO, b"kept") == b"k" * 100
    async with open_store(tmp_path, clean=True):
        pass
    Index(tmp_path / "state").close()                       # fsck or a tool opened it: no
    async with open_store(tmp_path, clean=True) as kvstore:   # marker, the kept totals serve
        assert kvstore.recovered["decoded"] == 0 and not kvstore.store.table_loaded
    env = lmdb.open(str(tmp_path / "state" / "index.lmdb"), max_dbs=8)
    with env.begin(write=True) as txn:                      # written behind kvfs's back
        txn.put(b"other", b"1", db=env.open_db(b"meta", txn=txn))
    env.close()
    Index(tmp_path / "state").close()       # whoever opens it first: the totals are not trusted
    async with open_store(tmp_path) as kvstore:
        assert kvstore.store.table_loaded     # a full recovery recounts them ...
    async with open_store(tmp_path) as kvstore:
        assert not kvstore.store.table_loaded and kvstore.recovered["decoded"] == 0    # ... for later starts


async def test_open_files_or_ram_only_objects_keep_the_unmount_unclean(tmp_path):
    async with open_store(tmp_path) as kvstore:
        fh, _, _ = await kvstore.files.create(ROOT_INO, b"open", 0o644, 0, 0)
        assert not kvstore.mark_clean()
        await kvstore.files.release(fh)
        await write(kvstore, ROOT_INO, b"in-ram", b"r" * 4000)
        assert not kvstore.mark_clean()                       # RAM-only, not written down
        await kvstore.store.mover.write_down_volatile()
        assert kvstore.mark_clean()


async def test_eviction_after_a_clean_start_waits_for_the_scan_and_keeps_prefixes(tmp_path):
    chain = [hx(f"h{i}") for i in range(4)]
    names = [f"{h}.kv".encode() for h in chain]
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20, clean=True) as kvstore:
        for i, h in enumerate(chain):
            await write(kvstore, ROOT_INO, names[i], block("ns", h, chain[i - 1] if i else "", 16 * (i + 1)))
        kv = dict(kvstore.ns.prefix.children)
        await kvstore.store.mover.write_down_volatile()
        lru = list(kvstore.store.lru["nvme"])
    assert len(kv) == 3 and len(lru) == 4
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20, clean=True) as kvstore:
        assert not kvstore.store.table_loaded      # closed before its scan ran: counts unknown
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20, clean=True) as kvstore:
        assert not kvstore.store.table_loaded and not kvstore.ns.prefix.children
        objtable.SCAN_BATCH = 1
        try:
            for _ in range(2):              # cancelled after its first step, twice: it resumes
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await kvstore.store.wait_loaded()
                assert not kvstore.store.table_loaded
            await kvstore.store.wait_loaded()
        finally:
            objtable.SCAN_BATCH = 500
        assert kvstore.ns.prefix.children == kv and list(kvstore.store.lru["nvme"]) == lru
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20) as kvstore:
        assert not kvstore.store.table_loaded
        k = 0
        while kvstore.store.counters["nvme"].evictions == 0:   # pressure: make_room waits for the scan
            await write(kvstore, ROOT_INO, b"plain%d" % k, os.urandom(60_000))
            await kvstore.store.mover.relieve()
            k += 1
            assert k < 60, "pressure never evicted"
        assert kvstore.store.table_loaded
        there = [kvstore.index.lookup(ROOT_INO, n) is not None for n in names]
        assert there == sorted(there, reverse=True), f"a parent went before its child: {there}"
