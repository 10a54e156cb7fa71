"""Volume format 2 (shared) on a file volume: join, claim, publish, tail, verified foreign reads.

Two SharedRemoteTiers (two nodes) open one file as the shared volume, as two daemons do on
one NVMe/TCP namespace (the target path is tests/remote/test_share.py). No target VM here.
"""
from __future__ import annotations

import random

import pytest

from kvfs.errors import ConfigError, NoSuchObject
from kvfs.remote import make_volume
from kvfs.remote.share import format as F
from kvfs.remote.tier import RemoteTier

from support.share import CHUNK, VOL, foreign_read, info_of, node  # noqa: F401


async def test_two_nodes_publish_tail_and_miss_after_free(tmp_path):
    vol = tmp_path / "shared.img"
    a = await node(vol, "node-a")
    b = await node(vol, "node-b")
    try:
        assert (a.slot, b.slot) == (0, 1) and a.region != b.region
        rnd = random.Random(7)
        blocks = {f"/m/{i:03x}.bin": rnd.randbytes(rnd.choice([1, 4096, 5000, 2 << 20])) for i in range(12)}
        locs = {}
        for oid, (key, data) in enumerate(blocks.items(), 1):
            locs[key] = (oid, await a.put(info_of(oid, data, key), memoryview(data)))
        assert await b.tailer.poll() == 12
        for key, data in blocks.items():
            assert await foreign_read(b, key) == data
        assert a.view.get("/m/000.bin") is None          # a node does not tail itself

        # A frees a block and reuses its space: B's tailer drops the name; a read by the old
        # location (a reader that had not polled yet) is a miss, never the new bytes
        key = "/m/003.bin"
        p_old = b.view.get(key)
        oid, loc = locs[key]
        await a.delete(oid, loc)
        new = b"N" * len(blocks[key])
        await a.put(info_of(100, new, "/m/other.bin"), memoryview(new))
        with pytest.raises(NoSuchObject):
            await b.read(999, F.pack_foreign_loc(p_old.slot, p_old.entry), 0, 10)
        assert await b.tailer.poll() == 2
        assert b.view.get(key) is None
        assert [path for path, _p in b.view.dropped] == [key]
        assert await foreign_read(b, "/m/other.bin") == new

        # rewrite: a new version of a name replaces the view's entry
        v2 = b"2" * 7000
        await a.put(info_of(101, v2, "/m/000.bin", gen=2), memoryview(v2))
        await b.tailer.poll()
        assert await foreign_read(b, "/m/000.bin") == v2
        assert b.view.get("/m/000.bin").entry.generation == 2

        # a block put under a runtime's temp name, then renamed: republished, the temp name dropped
        tmp = b"T" * 3000
        info = info_of(102, tmp, "/m/t.bin_1.tmp")
        loc = await a.put(info, memoryview(tmp))
        await b.tailer.poll()
        assert await foreign_read(b, "/m/t.bin_1.tmp") == tmp
        b.view.dropped.clear()
        import dataclasses
        await a.republish(dataclasses.replace(info, key="/m/t.bin"), loc)
        await b.tailer.poll()
        assert b.view.get("/m/t.bin_1.tmp") is None and await foreign_read(b, "/m/t.bin") == tmp
        assert [path for path, _p in b.view.dropped] == ["/m/t.bin_1.tmp"]
        assert b.view.children("/m") >= {"t.bin", "000.bin"} and "t.bin_1.tmp" not in b.view.children("/m")
    finally:
        await a.close()
        await b.close()

    # restart: each node gets its own slot and region back with a bumped epoch, its log goes on
    a2 = await node(vol, "node-a")
    try:
        assert (a2.slot, a2.region, a2.node.epoch) == (0, a.region, a.node.epoch + 1)
        assert a2.logw.next_seq == a.logw.next_seq
        assert a2.objects == a.objects
        assert len(a2.view) == 0                 # B published nothing
    finally:
        await a2.close()
    c = await node(vol, "node-c")
    try:
        assert c.slot == 2 and c.region not in (a.region, b.region)
        assert await foreign_read(c, "/m/000.bin") == v2        # a full rescan at join
        assert c.view.get("/m/003.bin") is None
    finally:
        await c.close()


async def test_format_1_and_format_2_refuse_each_other(tmp_path):
    vol = tmp_path / "v.img"
    one = RemoteTier(make_volume(str(vol), create_size=VOL), instance_id="single", size="100%")
    await one.open()
    await one.close()
    with pytest.raises(ConfigError, match="single-node"):
        await node(vol, "node-a")
    a = await node(vol, "node-a", fmt=True)          # --format-remote turns it into a shared volume
    await a.close()
    with pytest.raises(ConfigError, match="version 2 is not supported"):
        await RemoteTier(make_volume(str(vol)), instance_id="single", size="100%").open()
    # a format-1 volume still belongs to one instance
    vol1 = tmp_path / "v1.img"
    await (await _open1(vol1, "first")).close()
    with pytest.raises(ConfigError, match="belongs to kvfs instance"):
        await _open1(vol1, "second")


async def _open1(path, iid: str) -> RemoteTier:
    t = RemoteTier(make_volume(str(path), create_size=VOL), instance_id=iid, size="100%")
    await t.open()
    return t


async def test_claim_rows_see_each_other_and_a_torn_row_claims_all(tmp_path):
    """Two claims of one region written before either reads back: each node's check sees the
    other's claim (so neither keeps it); a row that does not verify counts as claiming all."""
    from kvfs.remote.share import member
    vol = make_volume(str(tmp_path / "c.img"), create_size=VOL)
    await vol.open()
    try:
        sb = F.Superblock2.plan(size=vol.size, lba_size=vol.block_size, max_nodes=2, regions=2)
        await member.write_unit(vol, 0, sb.pack(), sb.unit)
        await member.write_unit(vol, sb.claim_off(0), F.pack_claims({0: (1, 5)}, 1, 2, sb.unit), sb.unit)
        await member.write_unit(vol, sb.claim_off(1), F.pack_claims({0: (1, 6)}, 1, 2, sb.unit), sb.unit)
        rows = await member.read_claims(vol, sb)
        assert 0 in member._taken(rows, 0, 2) and 0 in member._taken(rows, 1, 2)
        # a torn row counts as claiming everything
        torn = bytearray(F.pack_claims({1: (1, 6)}, 1, 2, sb.unit))
        torn[20] ^= 0xFF
        await member.write_unit(vol, sb.claim_off(1), bytes(torn), sb.unit)
        assert (await member.read_claims(vol, sb))[1] is None
        assert member._taken(await member.read_claims(vol, sb), 0, 2) == {0, 1}
    finally:
        await vol.close()


def test_log_entry_roundtrip_and_torn_entry():
    e = F.LogEntry(5, 2, F.OP_PUT, 1, 300, 3, 1, 77, 4, 9000, 123, CHUNK, b"u" * 16, 42, "/ns/abc.bin")
    raw = bytearray(e.pack())
    assert F.unpack_entry(raw) == e
    raw[100] ^= 1
    assert F.unpack_entry(raw) is None
    with pytest.raises(ValueError):
        F.LogEntry(1, 1, F.OP_PUT, 0, key="x" * 600).pack()


async def test_a_ring_that_wraps_loses_no_record_for_a_reader(tmp_path):
    """A one-unit log (8 entries). B falls more than a ring behind (A puts 12 blocks, frees
    two of the oldest, renames one): B notices the sequence gap, re-reads A's ring and, since
    it wrapped, A's region table: its view holds every live block of A (not only the last
    ring's), without the freed ones, the renamed one under its new name. A node joining after
    the wrap sees the same."""
    vol = tmp_path / "ring.img"
    a = await node(vol, "node-a", log_units=1)
    b = await node(vol, "node-b")
    c = None
    try:
        assert a.sb2.log_entries == 8
        blocks = {f"/r/{oid}.bin": bytes([oid]) * (4096 + oid) for oid in range(1, 14)}
        locs = {}
        await a.put(info_of(1, blocks["/r/1.bin"], "/r/1.bin"), memoryview(blocks["/r/1.bin"]))
        await b.tailer.poll()
        assert b.view.get("/r/1.bin") is not None
        for oid in range(2, 14):
            key = f"/r/{oid}.bin"
            locs[oid] = await a.put(info_of(oid, blocks[key], key), memoryview(blocks[key]))
        for oid in (2, 3):
            await a.delete(oid, locs[oid])
            del blocks[f"/r/{oid}.bin"]
        info = info_of(4, blocks.pop("/r/4.bin"), "/r/four.bin")
        blocks["/r/four.bin"] = b"\x04" * 4100
        await a.republish(info, locs[4])
        assert a.logw.next_seq == 17                  # 13 puts, 2 frees, 1 rename: two rings
        await b.tailer.poll()
        assert b.tailer.rescans == 1 and b.tailer.wraps == 1 and b.tailer.region_scans == 1
        assert sorted(b.view.by_path) == sorted(blocks)
        for key, data in blocks.items():
            assert await foreign_read(b, key) == data, key
        assert b.tailer.next_seq[a.slot] == a.logw.next_seq
        assert "/r/1.bin" not in {p for p, _pub in b.view.dropped}    # still published: never dropped
        # a node that joins after the wrap: the same view
        await a.heartbeat()
        c = await node(vol, "node-c")
        assert sorted(c.view.by_path) == sorted(blocks) and c.tailer.wraps == 1
        assert await foreign_read(c, "/r/1.bin") == blocks["/r/1.bin"]
    finally:
        for t in (a, b, c):
            if t is not None:
                await t.close()


async def test_a_node_whose_slot_was_taken_over_is_fenced(tmp_path):
    """A restarted process of the same node id (A frozen, restarted elsewhere) takes the slot
    with a higher epoch: the old process's next write finds the slot changed and refuses; it
    never writes again, and the new one owns the region and its records."""
    from kvfs.errors import TierUnavailable
    vol = tmp_path / "fence.img"
    old = await node(vol, "node-a")
    data = b"o" * 5000
    await old.put(info_of(1, data, "/f/old.bin"), memoryview(data))
    new = await node(vol, "node-a")
    try:
        assert (new.slot, new.region, new.node.epoch) == (old.slot, old.region, old.node.epoch + 1)
        with pytest.raises(TierUnavailable, match="fenced"):
            await old.put(info_of(2, data, "/f/stale.bin"), memoryview(data))
        assert not old.available and old.status()["state"] == "fenced"
        assert "epoch 2" in old.status()["share"]["fenced"]
        with pytest.raises(TierUnavailable):
            await old.put(info_of(3, data, "/f/stale2.bin"), memoryview(data))
        loc = await new.put(info_of(4, data, "/f/new.bin"), memoryview(data))
        assert bytes(await new.read(4, loc, 0, len(data))) == data
        assert new.objects == 2 and new.logw.next_seq == 3       # the old put, then the new one
    finally:
        await old.close()
        await new.close()
