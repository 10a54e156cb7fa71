"""The placement policy (kvfs/store/policy.py) on its own decisions: victim choice (LRU, fair
between namespaces, what is in use, pinning, the prefix rule, a quota's victims), watermarks,
demote-or-evict with admission, and promotion. Real tiers (tmpfs, a directory), real LMDB, no
kernel; nothing is moved here except to set a scene (the mover's own tests: test_mover.py)."""
from __future__ import annotations

import os
import stat
import time

import pytest

from kvfs.errors import TierFull
from kvfs.store.index import ROOT_INO
from support.store import block, file_remote_tier, hx, open_store, write_file

KiB = 1 << 10


async def put(kvstore, parent: int, name: bytes, size: int = 64 * KiB):
    ino = await write_file(kvstore, parent, name, os.urandom(size))
    return kvstore.ns.sealed[ino]


def mkdir(kvstore, name: bytes) -> int:
    return kvstore.names.make(ROOT_INO, name, stat.S_IFDIR | 0o755, 0, 0)[0]


async def test_victims_are_least_recently_used_from_the_namespace_furthest_over_its_share(tmp_path):
    async with open_store(tmp_path) as kvstore:
        store, policy = kvstore.store, kvstore.store.policy
        a, b = mkdir(kvstore, b"a"), mkdir(kvstore, b"b")
        a1, a2, a3 = [await put(kvstore, a, b"f%d" % i) for i in range(3)]
        await put(kvstore, b, b"g")
        assert policy.victim(store.ram) is a1       # a holds most of RAM; its oldest first
        store.note_open(a1)                         # used again: now the most recent of a
        assert policy.victim(store.ram) is a2
        a2.refs = 1                                 # open or leased: not a victim
        a3.busy = True                              # being moved: not a victim
        assert policy.victim(store.ram) is a1
        a1.refs = 1
        # nothing of a can go: b gives one up (the fair order is a ranking, not a veto)
        assert policy.victim(store.ram).key == "/b/g"
        a1.refs = a2.refs = 0
        a3.busy = False
        assert policy.victim(store.ram) is a2       # a's order: a2, a3, a1


async def test_pinning_keeps_an_object_on_the_lowest_tier_but_not_in_ram(tmp_path):
    async with open_store(tmp_path) as kvstore:
        store, policy = kvstore.store, kvstore.store.policy
        old, new = await put(kvstore, ROOT_INO, b"old"), await put(kvstore, ROOT_INO, b"new")
        old.pinned = True
        assert policy.victim(store.ram) is old      # demotion keeps it: pinning does not stop it
        for obj in (old, new):
            await store.mover.demote(obj, 0)
        nvme = store.tiers[1]
        assert policy.lowest() == 1
        assert policy.victim(nvme) is new           # eviction would lose it: pinned stays
        new.pinned = True
        assert policy.victim(nvme) is None


async def test_the_prefix_rule_keeps_a_block_with_cached_children(tmp_path):
    async with open_store(tmp_path) as kvstore:
        store, policy = kvstore.store, kvstore.store.policy
        parent, child = hx("p"), hx("c")
        pino = await write_file(kvstore, ROOT_INO, f"{parent}.kv".encode(), block("ns", parent, "", 16))
        cino = await write_file(kvstore, ROOT_INO, f"{child}.kv".encode(), block("ns", child, parent, 32))
        p, c = kvstore.ns.sealed[pino], kvstore.ns.sealed[cino]
        assert policy.prefix.children == {("ns", parent): 1}
        assert not policy.prefix.may_evict(p) and policy.prefix.may_evict(c)
        assert policy.victim(store.ram) is p        # RAM demotes: the rule is about eviction
        for obj in (p, c):
            await store.mover.demote(obj, 0)
        assert policy.victim(store.tiers[1]) is c   # the older parent stays while its child is cached
        assert policy.namespace_victims("/") == [c]      # a quota's victims follow the same rule
        await store.mover.evict(c)
        assert policy.prefix.children == {} and policy.victim(store.tiers[1]) is p


async def test_a_quotas_victims_are_its_idle_files_oldest_first_on_any_tier(tmp_path):
    async with open_store(tmp_path) as kvstore:
        store, policy = kvstore.store, kvstore.store.policy
        a, b = mkdir(kvstore, b"a"), mkdir(kvstore, b"b")
        f0, f1, f2, f3 = [await put(kvstore, a, b"f%d" % i) for i in range(4)]
        await put(kvstore, b, b"other")
        await store.mover.demote(f1, 0)             # on NVMe: still one of a's files
        f2.pinned = True
        f3.refs = 1
        assert policy.namespace_victims("a") == [f0, f1]
        assert policy.namespace_victims("a", keep=f0) == [f1]
        f0.atime = time.time() + 10                 # used last
        assert policy.namespace_victims("a") == [f1, f0]
        assert [o.key for o in policy.namespace_victims("b")] == ["/b/other"]
        assert policy.namespace_victims("nobody") == []


async def test_watermarks(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, high=0.9, low=0.6) as kvstore:
        store, policy = kvstore.store, kvstore.store.policy
        ram, nvme = store.tiers
        assert policy.target(ram) == 0.6 * ram.capacity
        assert not policy.pressed() and not policy.over_high(ram)
        n = 0
        while ram.used <= 0.9 * ram.capacity:
            await put(kvstore, ROOT_INO, b"f%d" % n, 96 * KiB)
            n += 1
            assert n < 20, "RAM never passed its high watermark"
            assert policy.pressed() == policy.over_high(ram) == (ram.used > 0.9 * ram.capacity)
        assert policy.pressed() and not policy.over_high(nvme)
        store.kick()                                # the pressure loop is woken
        assert not store.settled()


async def test_demote_or_evict_and_admission(tmp_path):
    async with open_store(tmp_path, admit_after={"nvme": 2}) as kvstore:
        store, policy = kvstore.store, kvstore.store.policy
        once, twice, pinned = [await put(kvstore, ROOT_INO, n) for n in (b"once", b"twice", b"pinned")]
        store.note_open(twice)
        pinned.pinned = True
        assert not policy.admitted(once, 0) and policy.admitted(twice, 0)
        assert store.telemetry.admission_dropped == {"nvme": 1}
        assert policy.way(once, 0, True) == "evict"      # NVMe wants 2 uses: dropped instead
        assert store.telemetry.admission_dropped == {"nvme": 2}
        assert policy.way(twice, 0, True) == "demote"
        assert policy.way(pinned, 0, True) == "demote"   # never evicted
        assert policy.way(once, 0, False) == "demote"    # a promotion's room never evicts
        await store.mover.demote(twice, 0)
        assert policy.admitted(twice, 1)                 # nothing below NVMe asks
        assert policy.way(twice, 1, True) == "evict"     # the lowest tier evicts
        with pytest.raises(TierFull):
            policy.way(twice, 1, False)


async def test_promotion(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, low=0.6) as kvstore:
        store, policy = kvstore.store, kvstore.store.policy
        small, big = await put(kvstore, ROOT_INO, b"small"), await put(kvstore, ROOT_INO, b"big", 700 * KiB)
        assert not policy.promotable(small)               # already in RAM
        assert not policy.wants_promotion(small, time.time())
        for obj in (small, big):
            await store.mover.demote(obj, 0)
        assert policy.promotable(small)
        assert not policy.promotable(big)                 # more than RAM's low watermark
        assert policy.promote_hits == 2
        t = time.time() + policy.promote_window + 1        # past the window of the open in RAM
        assert not policy.wants_promotion(small, t)
        assert policy.wants_promotion(small, t + 1)       # 2 opens within the window
        assert not policy.wants_promotion(small, t + 1 + policy.promote_window + 1)   # a new window
        assert policy.promotion_may_evict()


async def test_with_the_remote_tier_down(tmp_path):
    remote = await file_remote_tier(tmp_path)
    async with open_store(tmp_path, extra_tiers=[remote]) as kvstore:
        store, policy = kvstore.store, kvstore.store.policy
        nvme = store.tiers[1]
        old, both = await put(kvstore, ROOT_INO, b"old"), await put(kvstore, ROOT_INO, b"both")
        await store.mover.demote(old, 0)
        await store.mover.demote(both, 0)
        await store.mover.demote(both, 1)
        await store.mover.promote(both)
        assert set(old.place) == {"nvme"} and set(both.place) == {"ram", "remote"}
        assert policy.lowest() == 2 and policy.promotion_may_evict()
        await remote.vol.close()
        assert policy.lowest() == 1                        # NVMe is the lowest reachable tier
        assert not policy.promotion_may_evict()            # a promotion must not evict now
        await store.mover.demote(both, 0)                  # copied to NVMe: the remote is down
        assert set(both.place) == {"nvme", "remote"}
        # NVMe's LRU object is ``old``, but dropping ``both``'s copy there loses nothing
        assert policy.victim(nvme) is both and policy.way(both, 1, True) == "demote"
        await remote.vol.open()
        assert policy.victim(nvme) is old                  # NVMe demotes again: plain LRU
