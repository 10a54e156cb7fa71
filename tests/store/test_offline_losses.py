"""What ``kvfs umount`` of a dead daemon's mount says the next mount will drop
(``kvfs.store.tally.offline_losses``, the index read without opening it for writing) is what
that start then drops: with valid totals (its two sets) and without (every record walked).
Real tiers and LMDB, no kernel: the "crash" is closing without the clean unmount."""
from __future__ import annotations

from kvfs.store import tally
from kvfs.store.index import Index, ROOT_INO
from support.store import open_store
from test_crash_start import _build


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
