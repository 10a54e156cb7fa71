"""RAM-tier write buffers: in the daemon's memory below ``mapped_min``, a tmpfs file from it on,
spilled to NVMe under pressure; the bytes and the tier's accounting stay right throughout."""
from __future__ import annotations

import os
import resource
import uuid
from pathlib import Path

import xxhash

from kvfs.store import checksum  # noqa: E402
from kvfs.store.ram import FD_RESERVE_MIN, RamTier, mapping_budget  # noqa: E402
from kvfs.store.tier import ObjectInfo  # noqa: E402
from support.store import nvme_tier  # noqa: E402

MIN = 64 << 10      # mapped_min of these tests


async def ram(mapped_min: int = MIN) -> RamTier:
    t = RamTier(64 << 20, "/dev/shm", uuid.uuid4().hex, mapped_min=mapped_min)
    await t.open()
    return t


def staged_files(t: RamTier) -> list[str]:
    return os.listdir(t.staging.path)


def seal(t: RamTier, oid: int, staging) -> bytes:
    """What the store does at seal: hash the buffer, then the tier adopts it."""
    with staging.mapped() as view:
        whole, sums = checksum.summarize(view, 1 << 20)
    info = ObjectInfo(oid, staging.size, whole, 1 << 20, sums, "k", 1)
    t.adopt(info, staging)
    staging.discard()
    return bytes(t.view(oid))


async def test_small_buffer_stays_in_memory_and_seals_to_the_same_bytes():
    t = await ram()
    try:
        s = t.new_staging()
        data = os.urandom(32 << 10)
        assert await s.write(0, data) == len(data)
        assert s.mem is data                        # one whole write is kept, not copied
        assert staged_files(t) == [] and s.fd < 0
        assert t.used == t.staged == len(data)
        assert await s.read(100, 50) == data[100:150]
        assert seal(t, 1, s) == data
        assert t.staged == 0 and t.used == len(data)
        assert xxhash.xxh3_64_intdigest(bytes(t.view(1))) == xxhash.xxh3_64_intdigest(data)
    finally:
        await t.close()


async def test_partial_writes_holes_and_truncate_in_memory():
    t = await ram()
    try:
        s = t.new_staging()
        await s.write(0, b"a" * 10)
        await s.write(5, memoryview(b"bbbbbbbbbb"))        # overlaps and extends
        await s.write(20, b"c")                             # past the end: a hole of zeros
        expect = b"aaaaa" + b"b" * 10 + b"\0" * 5 + b"c"
        assert s.size == len(expect) and await s.read(0, 100) == expect
        got = await s.read(0, 100)
        await s.write(0, b"Z")
        assert got == expect                                # a read returned a copy
        await s.truncate(7)
        assert await s.read(0, 100) == b"Zaaaabb"
        await s.truncate(12)
        assert await s.read(0, 100) == b"Zaaaabb" + b"\0" * 5
        assert t.used == t.staged == 12 and staged_files(t) == []
        s.discard()
        assert t.used == t.staged == 0
    finally:
        await t.close()


async def test_buffer_reaching_mapped_min_moves_to_a_file():
    t = await ram()
    try:
        s = t.new_staging()
        head, tail = os.urandom(MIN - 100), os.urandom(200)
        await s.write(0, head)
        assert staged_files(t) == []
        await s.write(len(head), tail)                      # crosses mapped_min
        assert s.mem is None and s.fd >= 0 and staged_files(t) == [s.name]
        assert await s.read(0, 1 << 20) == head + tail
        assert t.used == t.staged == MIN + 100
        assert seal(t, 2, s) == head + tail                 # a mapped object now
        assert t.backing(2, b"") is not None
    finally:
        await t.close()


async def test_truncate_to_mapped_min_and_fill_from_large_content_use_a_file():
    t = await ram()
    try:
        s = t.new_staging()
        await s.write(0, b"x" * 100)
        await s.truncate(MIN)
        assert s.mem is None and staged_files(t) == [s.name]
        assert await s.read(0, 1 << 20) == b"x" * 100 + b"\0" * (MIN - 100)
        s.discard()
        big = os.urandom(MIN * 2)
        s2 = t.new_staging()
        await s2.fill_from(memoryview(big))
        assert s2.mem is None and await s2.read(0, 1 << 20) == big
        s2.discard()
        s3 = t.new_staging()
        await s3.fill_from(memoryview(b"small"))
        assert s3.mem == b"small" and s3.fd < 0
        # the files discarded above are kept, empty, as spares for the next large buffer
        assert sorted(staged_files(t)) == sorted(name for name, _ in t._spare)
        assert all(os.path.getsize(t.staging.path / n) == 0 for n in staged_files(t))
        s3.discard()
        assert t.used == t.staged == 0
    finally:
        await t.close()


async def test_spill_from_memory_to_nvme(tmp_path):
    t = await ram()
    nv = await nvme_tier(tmp_path)
    try:
        s = t.new_staging()
        data = os.urandom(20_000)
        await s.write(0, data)
        await s.spill(nv.staging_dir)
        assert s.spilled and s.mem is None and s.fd >= 0
        assert t.used == t.staged == 0
        assert os.listdir(nv.staging_dir.path) == [s.name]
        await s.write(len(data), b"more")                   # keeps working on NVMe
        assert await s.read(0, 1 << 20) == data + b"more"
        s.discard()
        assert os.listdir(nv.staging_dir.path) == []
    finally:
        await nv.close()
        await t.close()


async def test_objects_past_the_mapping_budget_stay_in_memory():
    """Each mapped object holds a descriptor: past ``max_mapped`` an object of any size is kept
    in the daemon's memory (no lease backing), with the same bytes; deleting a mapped one makes
    room for the next."""
    t = await ram()
    try:
        t.max_mapped = 2
        want = {}
        for oid in (1, 2, 3):
            s = t.new_staging()
            want[oid] = os.urandom(MIN + 4096 * oid)
            await s.write(0, want[oid])
            assert s.fd >= 0                                  # a tmpfs buffer (at least mapped_min)
            assert seal(t, oid, s) == want[oid]
        assert t.mapped == 2
        assert t.backing(1, b"") is not None and t.backing(2, b"") is not None
        assert t.backing(3, b"") is None                      # in memory: read through the daemon
        assert sorted(os.listdir(t.home.path)) == ["0000000000000001", "0000000000000002", "staging"]
        assert bytes(await t.read(3, b"", 10, 100)) == want[3][10:110]
        await t.delete(1, b"")
        assert t.mapped == 1 and t.used == len(want[2]) + len(want[3])
        s = t.new_staging()
        data = os.urandom(MIN)
        await s.write(0, data)
        assert seal(t, 4, s) == data and t.backing(4, b"") is not None and t.mapped == 2
    finally:
        await t.close()


def test_the_mapping_budget_leaves_descriptors_for_the_rest():
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert 0 <= mapping_budget() <= soft - FD_RESERVE_MIN


async def test_the_tier_reports_its_mappings():
    t = await ram()
    try:
        t.max_mapped = 5
        s = t.new_staging()
        await s.write(0, os.urandom(MIN))
        seal(t, 1, s)
        st = t.status()
        assert st["fs_free"] > 0
        assert st == {"mapped": 1, "mapped_budget": 5, "fs_spills": 0, "fs_free": st["fs_free"]}
    finally:
        await t.close()
