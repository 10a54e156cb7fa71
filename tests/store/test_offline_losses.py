"""What ``kvfs umount`` of a dead daemon's mount says the next mount will drop
(``kvfs.store.tally.offline_losses``, the index read without opening it for writing) is what
that start then drops: with valid totals (its two sets) and without (every record walked).
Real tiers and LMDB, no kernel: the "crash" is closing without the clean unmount."""
from __future__ import annotations

import os
import stat

from kvfs.store import tally
from kvfs.store.index import Index, ROOT_INO
from support.store import open_store, write_file as write

FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


async def _build(kvstore) -> None:
    """In /a and /b: durable files, files replaced by a RAM-only version, RAM-only files,
    files created and never sealed, one being written."""
    a, _ = kvstore.ns.make(ROOT_INO, b"a", DIR, 0, 0)
    b, _ = kvstore.ns.make(ROOT_INO, b"b", DIR, 0, 0)
    for i in range(6):
        d = a if i % 2 else b
        await write(kvstore, d, b"f%d" % i, os.urandom(100 + i * 1111))
        await kvstore.store.mover.demote(kvstore.ns.sealed[kvstore.ns.lookup(d, b"f%d" % i)], 0)
    await write(kvstore, a, b"f3.tmp", os.urandom(5000))           # a RAM-only version over f3
    await kvstore.names.rename(a, b"f3.tmp", a, b"f3", 0)
    for i in range(5):
        await write(kvstore, b, b"ram%d" % i, os.urandom(3000 + i))
    for i in range(4):
        kvstore.ns.make(a, b"unsealed%d" % i, FILE, 0, 0, oid=None)
    fh, _, _ = await kvstore.files.create(b, b"open", 0o644, 0, 0)
    await kvstore.files.write(fh, 0, b"x" * 1000)


async def test_offline_losses_name_what_the_next_start_drops(tmp_path):
    async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
        await _build(kvstore)
        kvstore.index.commit()
    state = tmp_path / "state"
    fast = tally.offline_losses(state, limit=100)
    assert fast["from"] == "tally"
    ix = Index(state)
    tally.invalidate(ix)
    ix.close()
    full = tally.offline_losses(state, limit=100)
    assert full["from"] == "records"
    for lost in (fast, full):
        assert (lost["unsealed"], lost["ram_only"]) == (5, 6), lost
        assert sorted(lost["files"]) == sorted(
            ["/a/unsealed%d" % i for i in range(4)] + ["/b/open", "/a/f3"]
            + ["/b/ram%d" % i for i in range(5)])
    async with open_store(tmp_path, ram=1 << 20, nvme=8 << 20) as kvstore:
        got = kvstore.recovered
        assert got["dropped_files"] == fast["unsealed"] + fast["ram_only"]
        assert got.get("lost_objects", fast["ram_only"]) == fast["ram_only"]
        a = kvstore.ns.lookup(ROOT_INO, b"a")
        assert b"unsealed0" not in {n for _e, n, _i, _r in kvstore.names.entries(a, 0)}
    assert tally.offline_losses(state)["unsealed"] == 0     # dropped: nothing left to drop
