"""The name table's writer (kvfs.store.names) and reader (kvfs.kv.names) on a real shared-memory
file, without a mount: the transaction hook's ordering, growth, tombstones, stale tables."""
from __future__ import annotations

import os
import tempfile
import threading

import pytest

from kvfs.kv.names import NameView
from kvfs.protocol import H_DIRS, H_GENERATION, H_MAGIC, H_RUN, H_VERSION, NAMES_STALE
from kvfs.store.index import DIRENTS, k64
from kvfs.store.names import MIN_CAPACITY, NameTable, retire


class Reader(NameView):
    """A NameView told the table's path and run directly (what ``.kvfs/stats`` says)."""

    def __init__(self, table: NameTable, **kw):
        super().__init__("/nonexistent", **kw)
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


class Stats:
    """os.stat of real directories, counted (what PageStore's guarded stat counts)."""

    def __init__(self):
        self.n = 0

    def __call__(self, path):
        self.n += 1
        return os.stat(path)


def dir_table(tmp_path):
    """A table holding the file ``x`` of a real directory ``d``; ``d``'s stat."""
    d = tmp_path / "d"
    d.mkdir()
    st = os.stat(d)
    t = NameTable(str(tmp_path / "shm"))
    os.mkdir(t.dir)
    t.open([(st.st_ino, b"x")])
    return t, str(d), st


def test_directory_inode_cached_until_a_directory_goes(tmp_path):
    """No stat per call while H_DIRS stays; a transaction that removes a directory moves it
    before its changes are visible (a reader inside the commit already re-stats), also across
    a rebuild of the table."""
    t, d, st = dir_table(tmp_path)
    stat = Stats()
    r = Reader(t, dev=st.st_dev, stat=stat, revalidate=None)
    try:
        assert r.absent_in(d, "y") and not r.absent_in(d, "x")
        n = stat.n
        assert n <= 2                       # before the table was mapped, and the first cached
        assert all(r.absent_in(d, f"y{i}") for i in range(100)) and stat.n == n
        seen = []

        def commit():
            seen.append((t.t.words[H_DIRS], r.absent_in(d, "y")))
        t.apply(txn(removes=[(99, b"somedir")]), commit, DIRENTS, dirs=True)
        assert seen == [(1, True)] and stat.n == n + 1      # counted before the commit: re-stat
        assert r.absent_in(d, "y") and stat.n == n + 1
        for i in range(2 * MIN_CAPACITY):                  # grown: the count goes with it
            t.apply(txn(adds=[(7, b"g%d" % i)]), lambda: None, DIRENTS)
        assert t.rebuilds >= 1 and t.t.words[H_DIRS] == 1 and t.statistics()["dirs_removed"] == 1
        assert r.absent_in(d, "y") and stat.n == n + 1
        t.apply(txn(adds=[(7, b"f")]), lambda: None, DIRENTS)   # files come and go: no re-stat
        t.apply(txn(removes=[(7, b"f")]), lambda: None, DIRENTS)
        assert r.absent_in(d, "y") and stat.n == n + 1
    finally:
        t.close()


def test_cached_inode_stat_again_and_checked_against_the_mount(tmp_path):
    """``revalidate=0``: a stat per call (what the default does once a second), and a
    directory that is no longer on the table's device (another mount at the path: here a
    symlink to another filesystem) is not answered; a version-1 table never vouches."""
    t, d, st = dir_table(tmp_path)
    stat = Stats()
    r = Reader(t, dev=st.st_dev, stat=stat, revalidate=0)
    other = tempfile.mkdtemp(dir="/dev/shm")
    try:
        for _ in range(3):
            assert r.absent_in(d, "y")
        assert stat.n == 3
        if os.stat(other).st_dev != st.st_dev:
            link = str(tmp_path / "link")
            os.symlink(d, link)
            assert r.absent_in(link, "y")
            os.unlink(link)
            os.symlink(other, link)
            assert not r.absent_in(link, "y")       # EXDEV: ask the filesystem
        t.t.words[H_VERSION] = 1                    # a daemon of version 1
        v1 = Reader(t, dev=st.st_dev, stat=(stat1 := Stats()), revalidate=None)
        for _ in range(3):
            assert v1.absent_in(d, "y") and not v1.absent_in(d, "x")
        assert stat1.n == 6
    finally:
        os.rmdir(other)
        t.close()


def test_retire_marks_a_dead_daemons_table_stale(tmp_path):
    t, d, st = dir_table(tmp_path)
    r = Reader(t, dev=st.st_dev, revalidate=None)
    assert r.absent_in(d, "y") and r.absent_in(d, "y")
    fd = os.open(t.dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert retire(fd)
    finally:
        os.close(fd)
    assert t.t.words[H_GENERATION] == NAMES_STALE
    assert not r.absent_in(d, "y")                  # the old table no longer answers
    t.close()
    fd = os.open(t.dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert not retire(fd)                       # none there (removed at close): False
    finally:
        os.close(fd)
