"""The ``.kvfs/lookup`` and ``.kvfs/lease`` protocols through the handlers (no kernel):
the base directive, the first miss ending the prefix, sealed-only answers, and leases that
hold objects in place until released, closed or expired."""
from __future__ import annotations

import errno
import json
import os
import types

import pyfuse3
import pytest
import trio
import xxhash


from kvfs.build import build_ops  # noqa: E402
from kvfs.fs import control  # noqa: E402
from kvfs.store.index import ROOT_INO  # noqa: E402
from support.store import open_store  # noqa: E402

CTX = types.SimpleNamespace(uid=0, gid=0, pid=os.getpid(), umask=0o022)


async def put(ops, parent, name: bytes, data: bytes) -> int:
    fi, attr = await ops.create(parent, name, 0o644, os.O_WRONLY, CTX)
    await ops.write(fi.fh, 0, data)
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    return attr.st_ino


async def ask(ops, fh: int, request: bytes) -> dict:
    await ops.write(fh, 0, request)
    return json.loads(await ops.read(fh, 0, 1 << 20))


async def open_ctl(ops, name: bytes) -> int:
    ctl = await ops.lookup(ROOT_INO, b".kvfs", CTX)
    ino = (await ops.lookup(ctl.st_ino, name, CTX)).st_ino
    return (await ops.open(ino, os.O_RDWR, CTX)).fh


@pytest.fixture
async def ops(tmp_path):
    async with open_store(tmp_path, ram=8 << 20, nvme=32 << 20) as kvstore:
        yield build_ops(kvstore, dict)


async def make_chain(ops, n: int, size: int = 1000) -> tuple[list[bytes], dict]:
    """``ns/<h[:2]>/<h>.kv`` files like a KV namespace; returns the relative names and inodes."""
    ns = (await ops.mkdir(ROOT_INO, b"ns", 0o755, CTX)).st_ino
    shards: dict[bytes, int] = {}
    rels, inos = [], {}
    for i in range(n):
        h = xxhash.xxh3_128_hexdigest(b"%d" % i).encode()
        if h[:2] not in shards:
            shards[h[:2]] = (await ops.mkdir(ns, h[:2], 0o755, CTX)).st_ino
        rel = h[:2] + b"/" + h + b".kv"
        inos[rel] = await put(ops, shards[h[:2]], h + b".kv", bytes([i % 256]) * size)
        rels.append(rel)
    return rels, inos


async def test_lookup_base_directive_and_first_miss(ops):
    rels, _ = await make_chain(ops, 40)
    fh = await open_ctl(ops, b"lookup")
    req = b"\0base ns\n" + b"\n".join(rels) + b"\n"
    assert await ask(ops, fh, req) == {"prefix": 40, "tiers": ["ram"] * 40}
    # the same chain as full paths (the first protocol) gives the same answer
    assert (await ask(ops, fh, b"\n".join(b"ns/" + r for r in rels)))["prefix"] == 40
    # a miss ends the prefix even when later names exist
    gap = rels[:7] + [b"zz/missing.kv"] + rels[7:]
    assert (await ask(ops, fh, b"\0base ns\n" + b"\n".join(gap)))["prefix"] == 7
    # a missing shard directory, a missing base, an empty request
    assert (await ask(ops, fh, b"\0base ns\nqq/x.kv\n" + rels[0]))["prefix"] == 0
    assert (await ask(ops, fh, b"\0base nope\n" + rels[0]))["prefix"] == 0
    assert await ask(ops, fh, b"") == {"prefix": 0, "tiers": []}
    # several bases in one request continue one chain
    two = b"\0base ns\n" + rels[0] + b"\n\0base /ns/\n" + rels[1] + b"\n"
    assert (await ask(ops, fh, two))["prefix"] == 2
    # a request split over several writes (as the kernel splits large writes)
    await ops.write(fh, 0, req[:100])
    await ops.write(fh, 100, req[100:])
    assert json.loads(await ops.read(fh, 0, 1 << 20))["prefix"] == 40
    await ops.release(fh)


async def fuse_errno(coro):
    with pytest.raises(pyfuse3.FUSEError) as ei:
        await coro
    return ei.value.errno


async def test_unknown_directive_is_einval(ops):
    fh = await open_ctl(ops, b"lookup")
    await ops.write(fh, 0, b"\0bogus x\n")
    assert await fuse_errno(ops.read(fh, 0, 4096)) == errno.EINVAL
    await ops.release(fh)


async def test_only_sealed_regular_files_count(ops):
    ns = (await ops.mkdir(ROOT_INO, b"ns", 0o755, CTX)).st_ino
    await put(ops, ns, b"a", b"x" * 10)
    await ops.mkdir(ns, b"dir", 0o755, CTX)
    await ops.symlink(ns, b"link", b"a", CTX)
    fi, _ = await ops.create(ns, b"writing", 0o644, os.O_WRONLY, CTX)     # never sealed yet
    await ops.write(fi.fh, 0, b"partial")
    fh = await open_ctl(ops, b"lookup")
    for name in (b"dir", b"link", b"writing"):
        assert (await ask(ops, fh, b"\0base ns\na\n" + name + b"\n"))["prefix"] == 1, name
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    assert (await ask(ops, fh, b"\0base ns\na\nwriting\n"))["prefix"] == 2
    # a sealed file rewritten in place still counts (its old version is sealed)
    fi = await ops.open((await ops.lookup(ns, b"a", CTX)).st_ino, os.O_WRONLY | os.O_TRUNC, CTX)
    assert (await ask(ops, fh, b"\0base ns\na\n"))["prefix"] == 1
    await ops.release(fi.fh)
    # unlinked and renamed names
    await ops.unlink(ns, b"a", CTX)
    assert (await ask(ops, fh, b"\0base ns\na\n"))["prefix"] == 0
    await ops.rename(ns, b"writing", ns, b"a", 0, CTX)
    assert (await ask(ops, fh, b"\0base ns\na\nwriting\n"))["prefix"] == 1
    await ops.release(fh)


async def test_sealed_map_survives_restart(tmp_path):
    async with open_store(tmp_path) as kvstore:
        ops = build_ops(kvstore, dict)
        rels, _ = await make_chain(ops, 5, size=200_000)
        await kvstore.store.mover.write_down_volatile()
    async with open_store(tmp_path) as kvstore:
        ops = build_ops(kvstore, dict)
        fh = await open_ctl(ops, b"lookup")
        assert await ask(ops, fh, b"\0base ns\n" + b"\n".join(rels)) == {"prefix": 5, "tiers": ["nvme"] * 5}


def _check_backing(block, data: bytes) -> None:
    tier, path, offset, size, checksum, direct = block
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.read(size)
    assert got == data and checksum == f"{xxhash.xxh3_64_intdigest(data):016x}"


async def test_lease_hands_out_backing_locations_and_holds_objects(ops):
    kvstore = ops.store
    rels, inos = await make_chain(ops, 4, size=1 << 20)          # >= 1 MiB: tmpfs-backed in RAM
    obj0 = kvstore.store.objs[kvstore.files.getattr(inos[rels[0]]).oid]
    await kvstore.store.mover.demote(obj0, 0)                            # block 0 on NVMe, the rest in RAM
    fh = await open_ctl(ops, b"lease")
    ans = await ask(ops, fh, b"\0base ns\n" + b"\n".join(rels) + b"\nzz/missing.kv\n")
    assert ans["prefix"] == 4 and ans["tiers"] == ["nvme", "ram", "ram", "ram"]
    assert [b[0] for b in ans["blocks"]] == ["nvme", "ram", "ram", "ram"]
    for i, block in enumerate(ans["blocks"]):
        _check_backing(block, bytes([i]) * (1 << 20))
    assert ans["blocks"][0][5] == kvstore.store.tiers[1].direct
    assert kvstore.statistics()["leases"] == 1
    objs = [kvstore.store.objs[kvstore.files.getattr(inos[r]).oid] for r in rels]
    assert all(o.refs == 1 for o in objs) and all(o.hits == 1 for o in objs)
    # leased objects are not demoted and their bytes are not freed when their names go
    kvstore.store.ram.capacity = 1 << 20
    await kvstore.store.mover.relieve()
    assert all(o.place.get("ram") is not None for o in objs[1:])
    shard = (await ops.lookup((await ops.lookup(ROOT_INO, b"ns", CTX)).st_ino, rels[1][:2], CTX)).st_ino
    await ops.unlink(shard, rels[1][3:], CTX)
    _check_backing(ans["blocks"][1], bytes([1]) * (1 << 20))
    # a new request on the descriptor releases the lease: the unlinked object is freed now
    ans2 = await ask(ops, fh, b"\0base ns\n" + rels[0] + b"\n")
    assert ans2["prefix"] == 1 and ans2["lease"] != ans["lease"]
    assert not os.path.exists(ans["blocks"][1][1])
    assert objs[0].refs == 1 and objs[2].refs == 0
    # \0release grants nothing and releases; close releases too
    assert await ask(ops, fh, b"\0release\n") == {"released": True}
    assert objs[0].refs == 0 and kvstore.statistics()["leases"] == 0
    await ask(ops, fh, b"\0base ns\n" + rels[0] + b"\n")
    assert objs[0].refs == 1
    await ops.release(fh)
    assert objs[0].refs == 0 and kvstore.leases.live == {}


async def test_lease_expires(ops):
    kvstore = ops.store
    rels, inos = await make_chain(ops, 2, size=1 << 20)
    fh = await open_ctl(ops, b"lease")
    ans = await ask(ops, fh, b"\0ttl 0.05\n\0base ns\n" + b"\n".join(rels))
    assert ans["prefix"] == 2 and ans["ttl"] == 0.05
    obj = kvstore.store.objs[kvstore.files.getattr(inos[rels[0]]).oid]
    assert obj.refs == 1
    with trio.fail_after(10):
        while await kvstore.leases.expire() == 0:
            await trio.sleep(0.01)
    assert obj.refs == 0 and kvstore.leases.live == {}
    await ops.release(fh)               # releasing an expired lease is harmless
    assert obj.refs == 0


async def test_lease_without_fast_path_gives_null(ops):
    rels, _ = await make_chain(ops, 2, size=1000)                # small: held in daemon memory
    fh = await open_ctl(ops, b"lease")
    ans = await ask(ops, fh, b"\0base ns\n" + b"\n".join(rels))
    assert ans["prefix"] == 2 and ans["blocks"] == [None, None]
    await ops.release(fh)
    stats_fh = await open_ctl(ops, b"lookup")
    await ops.release(stats_fh)
    assert control.is_control(control.LEASE)


async def test_lease_answer_follows_placement(ops):
    """Lease entries are memoised per object: a block that moved is answered where it is now."""
    kvstore = ops.store
    rels, inos = await make_chain(ops, 3, size=1 << 20)
    fh = await open_ctl(ops, b"lease")
    first = await ask(ops, fh, b"\0base ns\n" + b"\n".join(rels))
    assert [b[0] for b in first["blocks"]] == ["ram", "ram", "ram"]
    assert await ask(ops, fh, b"\0base ns\n" + b"\n".join(rels)) == dict(first, lease=first["lease"] + 1)
    await ask(ops, fh, b"\0release\n")
    obj1 = kvstore.store.objs[kvstore.files.getattr(inos[rels[1]]).oid]
    await kvstore.store.mover.demote(obj1, 0)                            # block 1 leaves RAM for NVMe
    again = await ask(ops, fh, b"\0base ns\n" + b"\n".join(rels))
    assert [b[0] for b in again["blocks"]] == ["ram", "nvme", "ram"]
    assert again["blocks"][0] == first["blocks"][0] and again["blocks"][1] != first["blocks"][1]
    for i, block in enumerate(again["blocks"]):
        _check_backing(block, bytes([i]) * (1 << 20))
    await ops.release(fh)


async def test_lease_during_a_demotion_keeps_the_leased_copy(ops):
    """A block leased while a demotion is copying it keeps the copy the lease handed out: the
    demotion ends with both copies (durably recorded) and drops the upper one only later."""
    kvstore = ops.store
    rels, inos = await make_chain(ops, 1, size=1 << 20)
    obj = kvstore.store.objs[kvstore.files.getattr(inos[rels[0]]).oid]
    nvme = kvstore.store.tiers[1]
    real_put, entered, go = nvme.put, trio.Event(), trio.Event()

    async def put_when_told(info, data):          # the real NVMe put, held at its start
        entered.set()
        await go.wait()
        return await real_put(info, data)
    nvme.put = put_when_told
    fh = await open_ctl(ops, b"lease")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(kvstore.store.mover.demote, obj, 0)
        await entered.wait()
        ans = await ask(ops, fh, b"\0base ns\n" + rels[0] + b"\n")    # leased mid-copy
        assert ans["blocks"][0][0] == "ram"
        go.set()
    nvme.put = real_put
    assert set(obj.place) == {"ram", "nvme"}
    _check_backing(ans["blocks"][0], bytes([0]) * (1 << 20))        # still there, still right
    assert "nvme" in kvstore.index.get_object(obj.oid).place         # the NVMe copy is recorded
    await ask(ops, fh, b"\0release\n")
    await kvstore.store.mover.demote(obj, 0)              # not in use any more: the RAM copy goes
    assert set(obj.place) == {"nvme"} and not os.path.exists(ans["blocks"][0][1])
    await ops.release(fh)
