"""The name table's writer (kvfs.store.names) and reader (kvfs.kv.names) on a real shared-memory
file, without a mount: the transaction hook's ordering, growth, tombstones, stale tables."""
from __future__ import annotations

import os
import threading

import pytest

from kvfs.kv.names import NameView
from kvfs.protocol import H_MAGIC, H_RUN
from kvfs.store.index import DIRENTS, k64
from kvfs.store.names import MIN_CAPACITY, NameTable


class Reader(NameView):
    """A NameView told the table's path and run directly (what ``.kvfs/stats`` says)."""

    def __init__(self, table: NameTable):
        super().__init__("/nonexistent")
        self.path, self.run = table.path, table.run


def txn(adds=(), removes=()) -> dict:
    w = {(DIRENTS, k64(p) + n): k64(1) * 2 for p, n in adds}
    w.update({(DIRENTS, k64(p) + n): object() for p, n in removes})    # a deletion marker
    return w


@pytest.fixture
def table(tmp_path):
    t = NameTable(str(tmp_path))
    t.open([(1, b"a"), (2, b"b")])
    yield t
    t.close()


def test_adds_before_commit_and_removes_after(table):
    r = Reader(table)
    seen = []

    def commit():                       # what a lookup would see at the moment of the commit
        seen.append((r.absent(5, b"new"), r.absent(1, b"a")))
    table.apply(txn(adds=[(5, b"new")], removes=[(1, b"a")]), commit, DIRENTS)
    assert seen == [(False, False)]      # the new name already in, the old one still in
    assert r.absent(1, b"a") and not r.absent(5, b"new") and not r.absent(2, b"b")
    assert r.absent(2, b"a") and r.absent(1, b"b")


def test_growth_keeps_every_name_and_readers_remap(table):
    r = Reader(table)
    assert r.absent(9, b"x")
    old_gen = table.generation
    names = [(7, f"p{i}".encode()) for i in range(3 * MIN_CAPACITY)]
    for p, n in names:
        table.apply(txn(adds=[(p, n)]), lambda: None, DIRENTS)
    assert table.generation > old_gen and table.t.capacity > MIN_CAPACITY
    assert not any(r.absent(p, n) for p, n in names)
    assert r.remaps >= 2 and r.absent(9, b"x")
    for p, n in names:                  # tombstones: all gone, then the slots are reused
        table.apply(txn(removes=[(p, n)]), lambda: None, DIRENTS)
    assert all(r.absent(p, n) for p, n in names) and table.t.live == 2
    for p, n in names[:10]:
        table.apply(txn(adds=[(p, n)]), lambda: None, DIRENTS)
    assert not any(r.absent(p, n) for p, n in names[:10])


def test_reader_refuses_other_runs_and_falls_back_when_closed(table, tmp_path):
    r = Reader(table)
    r.run += 1                          # another daemon's table under that name
    assert not r.absent(9, b"x") and r._off
    r = Reader(table)
    assert r.absent(9, b"x")
    table.close()                       # marked stale and removed: ask the filesystem
    assert not os.path.exists(table.path)
    assert not r.absent(9, b"x")
    t2 = NameTable(str(tmp_path))
    t2.open([])
    with open(t2.path, "r+b") as f:    # a damaged header
        f.seek(8 * H_MAGIC)
        f.write(b"\0" * 8)
    r2 = Reader(t2)
    assert not r2.absent(9, b"x")
    assert t2.t.words[H_RUN] == t2.run
    t2.close()


def test_built_in_chunks_is_exact_for_changes_made_meanwhile(tmp_path):
    """The background build (begin, chunks of pre-existing entries read at any later time,
    finish) against changes applied between its chunks: a name removed meanwhile is skipped
    even when a chunk read before the removal reached LMDB still lists it; one added or
    re-added meanwhile is in; nothing is advertised until the build is done."""
    t = NameTable(str(tmp_path))
    old = [(7, f"o{i}".encode()) for i in range(3000)]
    t.begin(len(old))
    try:
        assert t.building and t.statistics() is None
        r = Reader(t)
        t.add_existing(old[:1000])
        t.apply(txn(adds=[(7, b"new1")], removes=[(7, b"o5"), (7, b"o1500"), (7, b"o2500")]), lambda: None, DIRENTS)
        t.apply(txn(adds=[(7, b"o2500")]), lambda: None, DIRENTS)          # re-added before its chunk
        t.add_existing(old[1000:2000])                                     # a stale read: still lists o1500
        t.apply(txn(adds=[(8, b"new2")], removes=[(7, b"new1"), (7, b"o10")]), lambda: None, DIRENTS)
        assert t.statistics() is None
        t.add_existing(old[2000:] + [(7, b"o10")])                         # o10 from a stale read too
        t.finish()
        st = t.statistics()
        assert not t.building and st is not None
        assert st["names"] == 3000 - 3 + 1                                 # o5, o1500, o10 gone; new2 in
        for p, n in old:
            assert r.absent(p, n) == (n in (b"o5", b"o1500", b"o10")), n
        assert not r.absent(8, b"new2") and r.absent(7, b"new1") and st["rebuilds"] == 0
    finally:
        t.close()


def test_one_view_shared_by_threads_survives_growth(table):
    """PageStore shares one view between the runtime's threads: a thread that remaps (the
    table grew) must not unmap what another is probing (that turned the view off for good)."""
    r = Reader(table)
    wrong, stop = [], threading.Event()

    def probe() -> None:
        while not stop.is_set():
            if r.absent(1, b"a") or r.absent(2, b"b"):
                wrong.append(1)
    threads = [threading.Thread(target=probe) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(20000):
            table.apply(txn(adds=[(9, b"g%d" % i)]), lambda: None, DIRENTS)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert table.rebuilds >= 3 and not wrong and not r._off and r.remaps >= 2
