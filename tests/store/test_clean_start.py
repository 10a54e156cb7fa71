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
from storekit import open_store
from storekit import block, hx, read_file as read, write_file as write

FILE = stat.S_IFREG | 0o644


def built(cache) -> int:
    return dict.__len__(cache.store.objs)


async def test_a_clean_start_builds_objects_on_first_use(tmp_path):
    want = {}
    async with open_store(tmp_path, clean=True) as cache:
        d, _ = cache.ns.make(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
        for i in range(40):
            want[b"f%d" % i] = os.urandom(i * 997)
            await write(cache, d, b"f%d" % i, want[b"f%d" % i])
        for i in range(1, 40, 3):          # some on NVMe only, the rest written down at close
            await cache.store.demote(cache.ns.sealed[cache.ns.lookup(d, b"f%d" % i)], 0)
        cache.xattrs.set(cache.ns.lookup(d, b"f5"), b"user.kvfs.pin", b"1")
    ix = Index(tmp_path / "state")                    # consumes the marker and the totals: ...
    tally.invalidate(ix)
    ix.close()
    async with open_store(tmp_path) as cache:         # ... what a full recovery computes
        assert cache.store.table_loaded
        nvme = cache.store.tiers[1]
        full = (nvme.used, nvme.objects, len(cache.store.objs), cache.telemetry.totals())
        lru = list(cache.store.lru["nvme"])
        pinned = {o.oid for o in cache.store.objs.values() if o.pinned}
    async with open_store(tmp_path, clean=True):      # marks it clean again
        pass
    async with open_store(tmp_path) as cache:
        nvme = cache.store.tiers[1]
        assert built(cache) == 0 and not cache.store.table_loaded
        assert (nvme.used, nvme.objects, len(cache.store.objs), cache.telemetry.totals()) == full
        d = cache.ns.lookup(ROOT_INO, b"d")
        assert await read(cache, d, b"f7") == want[b"f7"]
        assert built(cache) == 1
        ino5 = cache.ns.lookup(d, b"f5")
        assert cache.ns.sealed[ino5].pinned and cache.ns.sealed[ino5].oid in pinned
        await cache.store.wait_loaded()
        assert cache.store.table_loaded and list(cache.store.lru["nvme"]) == lru
        for name, data in want.items():
            assert await read(cache, d, name) == data
        assert {o.oid for o in cache.store.objs.values() if o.pinned} == pinned


async def test_the_clean_start_table_follows_changes_made_before_the_scan(tmp_path):
    async with open_store(tmp_path, clean=True) as cache:
        for i in range(30):
            await write(cache, ROOT_INO, b"f%d" % i, os.urandom(3000))
    async with open_store(tmp_path, clean=True) as cache:
        assert not cache.store.table_loaded
        gone = cache.ns.sealed[cache.ns.lookup(ROOT_INO, b"f3")].oid
        await cache.names.unlink(ROOT_INO, b"f3")
        await cache.names.rename(ROOT_INO, b"f4", ROOT_INO, b"f5", 0)
        new = cache.ns.sealed[await write(cache, ROOT_INO, b"new", b"n" * 5000)].oid
        await cache.store.wait_loaded()
        nvme_lru = list(cache.store.lru["nvme"])
        assert gone not in nvme_lru and len(cache.store.objs) == 29
        assert len(nvme_lru) == 28 and new in cache.store.lru["ram"]
    async with open_store(tmp_path) as cache:         # the crash path agrees
        assert len(cache.store.objs) == 29 and cache.store.tiers[1].objects == 29
        assert cache.index.lookup(ROOT_INO, b"f4") is None and await read(cache, ROOT_INO, b"new") == b"n" * 5000


async def test_any_open_consumes_the_marker_and_unsealed_files_go_at_a_clean_unmount(tmp_path):
    async with open_store(tmp_path, clean=True) as cache:
        await write(cache, ROOT_INO, b"kept", b"k" * 100)
        cache.ns.make(ROOT_INO, b"never-sealed", FILE, 0, 0, oid=None)
    async with open_store(tmp_path) as cache:
        assert not cache.store.table_loaded                 # a clean start ...
        assert cache.index.lookup(ROOT_INO, b"never-sealed") is None
        cache.ns.make(ROOT_INO, b"unsealed", FILE, 0, 0, oid=None)
        cache.index.commit()                                # ... then a "crash": no marker
    async with open_store(tmp_path) as cache:
        assert cache.recovered["dropped_files"] == 1        # the unsealed set dropped it ...
        assert cache.recovered["decoded"] == 1 and not cache.store.table_loaded    # ... alone
        assert cache.index.lookup(ROOT_INO, b"unsealed") is None
        assert await read(cache, ROOT_INO, b"kept") == b"k" * 100
    async with open_store(tmp_path, clean=True):
        pass
    Index(tmp_path / "state").close()                       # fsck or a tool opened it: no
    async with open_store(tmp_path, clean=True) as cache:   # marker, the kept totals serve
        assert cache.recovered["decoded"] == 0 and not cache.store.table_loaded
    env = lmdb.open(str(tmp_path / "state" / "index.lmdb"), max_dbs=8)
    with env.begin(write=True) as txn:                      # written behind kvfs's back
        txn.put(b"other", b"1", db=env.open_db(b"meta", txn=txn))
    env.close()
    Index(tmp_path / "state").close()       # whoever opens it first: the totals are not trusted
    async with open_store(tmp_path) as cache:
        assert cache.store.table_loaded     # a full recovery recounts them ...
    async with open_store(tmp_path) as cache:
        assert not cache.store.table_loaded and cache.recovered["decoded"] == 0    # ... for later starts


async def test_open_files_or_ram_only_objects_keep_the_unmount_unclean(tmp_path):
    async with open_store(tmp_path) as cache:
        fh, _, _ = await cache.files.create(ROOT_INO, b"open", 0o644, 0, 0)
        assert not cache.mark_clean()
        await cache.files.release(fh)
        await write(cache, ROOT_INO, b"in-ram", b"r" * 4000)
        assert not cache.mark_clean()                       # RAM-only, not written down
        await cache.store.write_down_volatile()
        assert cache.mark_clean()


async def test_eviction_after_a_clean_start_waits_for_the_scan_and_keeps_prefixes(tmp_path):
    chain = [hx(f"h{i}") for i in range(4)]
    names = [f"{h}.kv".encode() for h in chain]
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20, clean=True) as cache:
        for i, h in enumerate(chain):
            await write(cache, ROOT_INO, names[i], block("ns", h, chain[i - 1] if i else "", 16 * (i + 1)))
        kv = dict(cache.ns.kv_children)
        await cache.store.write_down_volatile()
        lru = list(cache.store.lru["nvme"])
    assert len(kv) == 3 and len(lru) == 4
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20, clean=True) as cache:
        assert not cache.store.table_loaded      # closed before its scan ran: counts unknown
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20, clean=True) as cache:
        assert not cache.store.table_loaded and not cache.ns.kv_children
        objtable.SCAN_BATCH = 1
        try:
            for _ in range(2):              # cancelled after its first step, twice: it resumes
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await cache.store.wait_loaded()
                assert not cache.store.table_loaded
            await cache.store.wait_loaded()
        finally:
            objtable.SCAN_BATCH = 500
        assert cache.ns.kv_children == kv and list(cache.store.lru["nvme"]) == lru
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20) as cache:
        assert not cache.store.table_loaded
        k = 0
        while cache.store.counters["nvme"].evictions == 0:   # pressure: make_room waits for the scan
            await write(cache, ROOT_INO, b"plain%d" % k, os.urandom(60_000))
            await cache.store.relieve()
            k += 1
            assert k < 60, "pressure never evicted"
        assert cache.store.table_loaded
        there = [cache.index.lookup(ROOT_INO, n) is not None for n in names]
        assert there == sorted(there, reverse=True), f"a parent went before its child: {there}"
