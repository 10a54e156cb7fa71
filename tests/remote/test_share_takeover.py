"""Failure detection and takeover on a shared volume (file volume, no VM; the daemon and
nvmet-target scenarios are in tests/remote/test_share.py).

The failure detector runs on each node's own monotonic clock; here every node's clock is one
shared counter the test moves forward (no sleeps, no wall-clock assertions), and the nodes'
heartbeat and tail steps are called directly, as their background loops would.
"""
from __future__ import annotations

import hashlib

import pytest
import trio

from kvfs.errors import NoSuchObject, TierUnavailable
from kvfs.remote import make_volume
from kvfs.remote.share import format as F
from kvfs.remote.share import member
from kvfs.remote.share.tier import SharedRemoteTier

from support.share import VOL, foreign_read, info_of

LEASE = 10.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def node(path, name: str, clock: Clock, *, takeover: bool = True) -> SharedRemoteTier:
    t = SharedRemoteTier(make_volume(str(path), create_size=VOL), instance_id=name, max_nodes=4, settle=0.01,
                         lease=LEASE, takeover=takeover)
    t.clock = clock
    await t.open()
    t.last_ack = clock()
    return t


def region_digest(path, t: SharedRemoteTier, region: int) -> str:
    sb2 = t.sb2
    with open(path, "rb") as f:
        f.seek(sb2.region_off(region))
        return hashlib.sha256(f.read(sb2.region_bytes)).hexdigest()


async def test_dead_node_region_taken_over_and_the_returning_node_refused(tmp_path):
    vol, clock = tmp_path / "shared.img", Clock()
    a = await node(vol, "node-a", clock)
    b = await node(vol, "node-b", clock, takeover=False)
    c = await node(vol, "node-c", clock)
    blocks = {f"/kv/{i:02x}.bin": bytes([i]) * (3000 + 900 * i) for i in range(6)}
    for oid, (key, data) in enumerate(blocks.items(), 1):
        await a.put(info_of(oid, data, key), memoryview(data))
    # C's own blocks use the same oids as A's: the views keep them apart (slot, region, oid)
    await c.put(info_of(1, b"c" * 5000, "/kv/c1.bin"), memoryview(b"c" * 5000))
    try:
        # A freezes (no heartbeat). B and C heartbeat every lease/4; nobody is dead before
        # lease + grace without a heartbeat of A
        for _ in range(5):
            clock.t += LEASE / 4
            for t in (b, c):
                await t.heartbeat()
                await t.tail_once()
            assert c.takeovers == 0, "A declared dead before lease + grace"
        assert b.available and c.available
        for _ in range(2):
            clock.t += LEASE / 4
            for t in (b, c):
                await t.heartbeat()
                await t.tail_once()
        assert c.takeovers == 1 and list(c.regions.held) == [a.region] and b.takeovers == 0
        assert c.regions.held[a.region]["writable_at"] >= clock.t + LEASE + c.grace
        st = c.status()["share"]
        held = st["held"][str(a.region)]
        assert (held["from_slot"], held["from_node"], held["from_epoch"]) == (a.slot, "node-a", a.node.epoch)
        assert (held["inherited_objects"], held["own_objects"], held["reclaimed"]) == (6, 0, 0)
        # B now sees A's blocks as published by C (A's log replayed, republished by C) and
        # reads them byte-equal; C's own block with the same oid is untouched
        await b.tail_once()
        for key, data in blocks.items():
            assert b.view.get(key).slot == c.slot
            assert await foreign_read(b, key) == data
        assert await foreign_read(b, "/kv/c1.bin") == b"c" * 5000
        assert not b.view.dropped

        # A resumes: its first put reads the claim rows, finds its region taken over and is
        # fenced for good (were the read lost, the write itself would refuse: no heartbeat
        # acknowledged for lease/2, test_a_short_freeze_...); its heartbeat writes nothing;
        # A's region on the volume is byte-for-byte what it was
        before = region_digest(vol, a, a.region)
        with pytest.raises(TierUnavailable, match="fenced: region .* taken over"):
            await a.put(info_of(50, b"z" * 4096, "/kv/late.bin"), memoryview(b"z" * 4096))
        await a.heartbeat()
        assert a.status()["state"] == "fenced" and "taken over" in a.fenced
        with pytest.raises(TierUnavailable, match="fenced"):
            await a.put(info_of(51, b"z" * 4096, "/kv/late2.bin"), memoryview(b"z" * 4096))
        await a.delete(1, (await _loc_of(a, 1)))          # a free of a lost block writes nothing
        assert region_digest(vol, a, a.region) == before
        slot_a = F.NodeSlot.unpack(await a.parent.read(a.sb2.slot_off(a.slot), a.sb2.unit))
        assert slot_a.heartbeat == 0 and slot_a.epoch == a.node.epoch   # no heartbeat written either
    finally:
        await a.close()

    # A restarts: a new epoch, its lost claim withdrawn, a new free region; never the old one
    a2 = await node(vol, "node-a", clock)
    try:
        assert a2.slot == a.slot and a2.node.epoch == a.node.epoch + 1
        assert a2.region not in (a.region, b.region, c.region) and a2.available
        rows = await member.read_claims(a2.parent, a2.sb2)
        assert a.region not in rows[a2.slot]
        loc = await a2.put(info_of(60, b"n" * 4096, "/kv/new.bin"), memoryview(b"n" * 4096))
        assert bytes(await a2.read(60, loc, 0, 4096)) == b"n" * 4096
        assert region_digest(vol, a2, a.region) == before
        await a2.tail_once()                      # A reads its old blocks like anyone's (C's now)
        assert await foreign_read(a2, "/kv/03.bin") == blocks["/kv/03.bin"]
        # a fourth node finds no free region: read-only, still reads the others' blocks
        d = await node(vol, "node-d", clock)
        try:
            assert d.region == -1 and d.status()["state"] == "fenced" and "read-only" in d.fenced
            with pytest.raises(TierUnavailable):
                await d.put(info_of(1, b"d" * 10, "/kv/d.bin"), memoryview(b"d" * 10))
            assert await foreign_read(d, "/kv/new.bin") == b"n" * 4096
            assert await foreign_read(d, "/kv/05.bin") == blocks["/kv/05.bin"]
        finally:
            await d.close()
    finally:
        await a2.close()
        await b.close()
        await c.close()


async def _loc_of(t: SharedRemoteTier, oid: int) -> bytes:
    from kvfs.remote.tier import _LOC
    for slot, (o, start, _size, units, hu) in t.entries.items():
        if o == oid:
            return _LOC.pack(1, slot, start, units, hu)
    raise AssertionError(f"object {oid} not on the tier")


async def test_takeover_claims_exclude_each_other_and_a_heartbeat_withdraws_one(tmp_path):
    vol, clock = tmp_path / "claims.img", Clock()
    a = await node(vol, "node-a", clock)
    b = await node(vol, "node-b", clock)
    c = await node(vol, "node-c", clock)
    try:
        sb2 = a.sb2
        seen = F.NodeSlot.unpack(await a.parent.read(sb2.slot_off(a.slot), sb2.unit))
        # the victim heartbeats after C saw it silent: C's claim is withdrawn
        await a.heartbeat()
        assert not await member.take_over(c.parent, sb2, c.slot, c.node.epoch, a.slot, seen, a.region)
        assert a.region not in (await member.read_claims(c.parent, sb2))[c.slot]
        # two claimants of one dead region: the second sees the first's claim and withdraws
        seen = F.NodeSlot.unpack(await a.parent.read(sb2.slot_off(a.slot), sb2.unit))
        assert await member.take_over(c.parent, sb2, c.slot, c.node.epoch, a.slot, seen, a.region)
        assert not await member.take_over(b.parent, sb2, b.slot, b.node.epoch, a.slot, seen, a.region)
        rows = await member.read_claims(c.parent, sb2)
        assert F.owners(rows, sb2.regions)[a.region] == [c.slot]
        assert a.region not in rows[b.slot]
    finally:
        for t in (a, b, c):
            await t.close()


async def test_a_short_freeze_partitions_then_resumes_when_the_region_is_still_ours(tmp_path):
    vol, clock = tmp_path / "pause.img", Clock()
    a = await node(vol, "node-a", clock)
    try:
        data = b"p" * 4096
        await a.put(info_of(1, data, "/kv/p1.bin"), memoryview(data))
        clock.t += LEASE / 2 + 0.1                    # no heartbeat acknowledged for lease/2
        with pytest.raises(TierUnavailable, match="partitioned"):
            await a.put(info_of(2, data, "/kv/p2.bin"), memoryview(data))
        assert not a.available and a.status()["share"]["partitions"] == 1
        assert a.status()["state"] == "partitioned"
        await a.tail_once()                           # a partitioned node claims nothing
        await a.heartbeat()                           # acknowledged, and nobody took the region
        assert a.available and a.status()["state"] != "partitioned"
        await a.put(info_of(2, data, "/kv/p2.bin"), memoryview(data))
        assert a.objects == 2
    finally:
        await a.close()


def test_share_lease_config_is_checked():
    from kvfs.config import Config
    from kvfs.errors import ConfigError
    for bad, msg in (({"share_lease": 0.01}, "share_lease"), ({"share_lease": "10"}, "share_lease"),
                     ({"share_grace": 601}, "share_grace")):
        with pytest.raises(ConfigError, match=msg):
            Config(share=True, remote="/tmp/x.img", **bad).validate()
    Config(share=True, remote="/tmp/x.img", share_lease=0.5, share_grace=0.1).validate()


def test_an_observer_that_was_away_does_not_declare_others_dead():
    """Liveness: silence the observer did not watch (it was frozen or disconnected for more
    than lease/2) is not death; the others get a fresh lease + grace from its next read."""
    live = member.Liveness(LEASE, LEASE / 2)
    a = F.NodeSlot("node-a", "", 1, 7, 0, 99, 0.0)
    live.observe([a], 0.0)
    live.observe([a], 2.5)
    assert live.dead(2.5) == []
    live.observe([a], 60.0)                 # the observer was away 57.5 s
    assert live.dead(60.0) == []
    for t in (62.5, 65.0, 67.5, 70.0, 72.5):
        live.observe([a], t)
    assert live.dead(72.5) == []            # 12.5 s of watched silence < lease + grace
    live.observe([a], 75.5)
    assert live.dead(75.5) == [0]
    live.observe([F.NodeSlot("node-a", "", 1, 8, 0, 99, 0.0)], 76.0)    # it heartbeats: alive
    assert live.dead(76.0) == []


async def _dead_and_taken(a, b, c, clock: Clock) -> None:
    """A stops heartbeating; B and C beat and tail until C holds A's region, then until
    C may write there (lease + grace + the I/O timeout after its claim)."""
    while not c.regions.held:
        clock.t += LEASE / 4
        for t in (b, c):
            await t.heartbeat()
            await t.tail_once()
    own = c.capacity        # the held region adds room only once C may write there
    assert own == c.regions.tiers[a.region].capacity and not c.status()["share"]["held"][str(a.region)]["writable"]
    while clock.t < c.regions.held[a.region]["writable_at"]:
        clock.t += LEASE / 4
        for t in (b, c):
            await t.heartbeat()
            await t.tail_once()


async def test_the_taker_frees_the_dead_nodes_blocks_and_reuses_their_space(tmp_path):
    vol, clock = tmp_path / "own.img", Clock()
    a = await node(vol, "node-a", clock)
    b = await node(vol, "node-b", clock, takeover=False)
    c = await node(vol, "node-c", clock)
    MiB = 1 << 20
    blocks = {f"/kv/a{i:02x}.bin": bytes([i + 1]) * MiB for i in range(8)}
    for oid, (key, data) in enumerate(blocks.items(), 1):
        await a.put(info_of(oid, data, key), memoryview(data))
    await b.tail_once()
    held_locs = {k: F.pack_foreign_loc(b.view.get(k).slot, b.view.get(k).entry) for k in blocks}
    try:
        await _dead_and_taken(a, b, c, clock)
        await b.tail_once()
        h = c.regions.tiers[a.region]
        assert len(h.inherited()) == 8 and c.used == 0 and c.capacity == 2 * h.capacity   # writable now
        # C fills its own region, then the region it holds: it has to free A's blocks there
        oid, mine = 1, {}               # C's oids start at 1 too: they meet A's in A's region

        async def put_c(o: int) -> None:
            data = bytes([0x80 | o % 64]) * MiB
            mine[o] = (await c.put(info_of(o, data, f"/kv/c{o:03x}.bin"), memoryview(data)), data)
        while h.reclaimed < 8:          # two puts at a time: reclaims must not overlap
            async with trio.open_nursery() as n:
                n.start_soon(put_c, oid)
                n.start_soon(put_c, oid + 1)
            oid += 2
            assert oid < 64, "C never needed A's space"
        assert not h.inherited() and len(h.own) >= 1
        assert len([r async for r in h.scan_records()]) == len(h.entries)    # every header intact
        assert c.used == sum(len(d) for _l, d in mine.values()) // MiB * (MiB + h.unit)
        for o, (loc, data) in mine.items():        # C reads its own blocks in both regions
            assert bytes(await c.read(o, loc, 0, len(data))) == data
        # B: every A block leaves its view (C published the frees) and a read by the old
        # location is a miss, never A's old bytes nor C's new ones
        await b.tail_once()
        for key, loc in held_locs.items():
            assert b.view.get(key) is None
            with pytest.raises(NoSuchObject):
                await b.read(999, loc, 0, MiB)
        assert any(p.entry.region == a.region for p in b.view.by_path.values() if p.slot == c.slot)
        for path, p in b.view.by_path.items():      # C's new blocks in A's old region read right
            if p.slot == c.slot and p.entry.region == a.region:
                o = p.entry.oid
                assert await foreign_read(b, path) == mine[o][1]
        # C frees one of its blocks in the held region: published, B drops it
        o = next(o for o, (loc, _d) in mine.items() if loc[0] == 3)
        path = f"/kv/c{o:03x}.bin"
        await c.delete(o, mine.pop(o)[0])
        await b.tail_once()
        assert b.view.get(path) is None
        # A returns with its stale epoch: fenced, writes nothing
        before = region_digest(vol, a, a.region)
        with pytest.raises(TierUnavailable, match="fenced"):
            await a.put(info_of(99, b"z" * 4096, "/kv/late.bin"), memoryview(b"z" * 4096))
        assert region_digest(vol, a, a.region) == before
    finally:
        await a.close()
    a2 = await node(vol, "node-a", clock)
    try:
        assert a2.node.epoch == a.node.epoch + 1 and a2.region != a.region
    finally:
        await a2.close()
    # C restarted: its own records in the held region are its own again (the index says
    # which: here the locs C got back), nothing is inherited any more
    await c.close()
    c2 = await node(vol, "node-c", clock)
    try:
        h2 = c2.regions.tiers[a.region]
        c2.recount([loc for loc, _d in mine.values()])
        assert not h2.inherited() and h2.own == h.own and c2.used == c.used
        for o, (loc, data) in mine.items():
            assert bytes(await c2.read(o, loc, 0, len(data))) == data
    finally:
        await c2.close()
        await b.close()
