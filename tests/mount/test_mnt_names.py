"""The name table (kvfs.store.names / kvfs.kv.names) through a real mount: the daemon's table
follows every way a name appears or goes (create, rename over, unlink, directory rename,
eviction), a reader never gets "absent" for a visible name (also while the table grows under
load), and a restarted daemon's clients remap or fall back. PageStore answers misses from it."""
from __future__ import annotations

import os
import threading

import pytest

from support.files import MiB, content, put, read
from support.mount import wait_for

from kvfs.integrations.pages import PageStore
from kvfs.kv.names import NameView

pytestmark = pytest.mark.mount


def settled(m) -> dict:
    return wait_for(lambda: (lambda s: s if s["settled"] else None)(m.stats()), 120, "the store to settle")


def table_ready(m) -> dict:
    """Wait for the daemon to advertise its name table (built in the background after mount)."""
    return wait_for(lambda: m.stats()["names"], 120, "the name table")


def opens(path) -> bool:
    """The file is there for a reader (ENOENT: not there)."""
    try:
        with open(path, "rb"):
            return True
    except FileNotFoundError:
        return False


def test_table_follows_create_rename_unlink_and_directory_rename(kvfs_mount):
    m = kvfs_mount()
    table_ready(m)
    view = NameView(str(m.path))
    d = m.path / "ns" / "sub"
    d.mkdir(parents=True)
    assert view.absent_in(str(d), "a.bin")
    put(d / "a.bin.tmp", b"a" * 100)
    assert not view.absent_in(str(d), "a.bin.tmp")
    os.replace(d / "a.bin.tmp", d / "a.bin")
    assert view.absent_in(str(d), "a.bin.tmp") and not view.absent_in(str(d), "a.bin")
    put(d / "b.tmp", b"b" * 100)
    os.replace(d / "b.tmp", d / "a.bin")                     # rename over an existing name
    assert not view.absent_in(str(d), "a.bin") and view.absent_in(str(d), "b.tmp")
    assert not view.absent_in(str(m.path), "ns") and not view.absent_in(str(m.path / "ns"), "sub/a.bin")
    os.rename(m.path / "ns", m.path / "moved")              # children keep their parent inode
    assert view.absent_in(str(m.path), "ns") and not view.absent_in(str(m.path / "moved"), "sub/a.bin")
    os.unlink(m.path / "moved" / "sub" / "a.bin")
    assert view.absent_in(str(m.path / "moved" / "sub"), "a.bin")
    os.rmdir(m.path / "moved" / "sub")
    assert view.absent_in(str(m.path / "moved"), "sub")
    st = m.stats()["names"]
    assert st["path"] == view.path and st["run"] == view.run and st["names"] == 1   # "moved"


def test_evicted_names_leave_the_table_and_visible_ones_stay(kvfs_mount):
    m = kvfs_mount(ram="4MiB", nvme_size="12MiB")
    table_ready(m)
    view = NameView(str(m.path))
    names = [f"b{i:02d}" for i in range(30)]
    for i, name in enumerate(names):
        put(m.path / "big" / name, content(name, MiB))
    st = settled(m)
    assert st["tiers"]["nvme"]["evictions"] > 0
    absent = {n for n in names if view.absent_in(str(m.path / "big"), n)}
    assert 0 < len(absent) < len(names)
    for n in names:                      # absent <=> a reader cannot open it (nothing moves now)
        assert opens(m.path / "big" / n) == (n not in absent), n
    assert sorted(p.name for p in (m.path / "big").iterdir()) == sorted(set(names) - absent)


def test_never_absent_while_visible_as_the_table_grows(kvfs_mount):
    """A writer makes 3,000 names (temp file, rename: the runtimes' pattern), which grows
    the table several times; readers check every name whose rename has returned."""
    m = kvfs_mount()
    table_ready(m)
    d = m.path / "pages"
    d.mkdir()
    done: list[str] = []
    stop = threading.Event()
    wrong: list[str] = []
    views = [NameView(str(m.path)) for _ in range(2)]    # two readers, each its own mapping

    def reader(view: NameView) -> None:
        while not stop.is_set():
            for n in done[-64:]:
                if view.absent_in(str(d), n):
                    wrong.append(n)
    threads = [threading.Thread(target=reader, args=(v,)) for v in views]
    for t in threads:
        t.start()
    try:
        for i in range(3000):
            fd = os.open(d / f".p{i}.tmp", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
            os.close(fd)
            os.rename(d / f".p{i}.tmp", d / f"p{i}")
            done.append(f"p{i}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert wrong == []
    st = m.stats()["names"]
    assert st["rebuilds"] >= 2 and st["capacity"] >= 8192   # 1024 slots hold 614 names and st["names"] == 3001
    assert all(v.remaps >= 2 for v in views)             # each followed a replaced table
    assert not any(views[0].absent_in(str(d), f"p{i}") for i in range(0, 3000, 7))
    assert views[0].absent_in(str(d), ".p5.tmp")


def test_page_store_misses_from_the_table_across_restarts(kvfs_mount):
    m = kvfs_mount()
    table_ready(m)
    store = PageStore(m.path, "pages")
    page = content("page", 4096)
    assert store.write_many(["have"], lambda i: [page]) == [True]
    base = store.statistics().table_misses                # write_many skips pages present
    assert store.prefix(["new1", "x"]) == 0 and store.prefix(["have"]) == 1
    assert store.hold(["new2"]) == (0, None)
    assert store.statistics().table_misses == base + 2
    store.close()                         # its control files would keep the mount busy
    old = NameView(str(m.path))
    assert old.absent_in(str(m.path / "pages"), "new1")
    m.remount()                           # clean: the old table is marked stale and removed
    assert not old.absent_in(str(m.path / "pages"), "new1")     # falls back (ask the mount)
    table_ready(m)
    old.reset()                           # rediscovers the new daemon's table
    assert old.absent_in(str(m.path / "pages"), "new1") and not old.absent_in(str(m.path / "pages"), "have")
    store = PageStore(m.path, "pages")
    assert store.prefix(["new3"]) == 0 and store.prefix(["have"]) == 1
    assert store.statistics().table_misses == 1
    m.kill9()                             # killed: its table is never marked stale
    m.mount()
    table_ready(m)
    assert store.prefix(["new4"]) == 0 and store.prefix(["have"]) == 1    # st_dev changed: remapped
    assert store.statistics().table_misses == 2 and store.statistics().reconnects >= 1
    assert read(m.path / "pages" / "have") == page
    store.close()


def test_page_store_hits_from_the_table_and_what_goes_is_no_longer_one(kvfs_mount):
    """Pages the table lists are counted present with no lookup request (one stat of the page
    directory per call, which a lazy unmount would fail); a page unlinked, or evicted, ends
    the prefix at once."""
    m = kvfs_mount(ram="8MiB", nvme_size="8MiB")
    table_ready(m)
    store = PageStore(m.path, "pages")
    names = [f"p{i:02d}" for i in range(20)]
    page = content("page", 64 << 10)
    assert store.write_many(names, lambda i: [page]) == [True] * 20
    assert store.prefix(names) == 20
    before = store.statistics()
    assert store.prefix(names) == 20 and store.prefix(names[:3]) == 3
    after = store.statistics()
    assert after.table_hits - before.table_hits == 23 and after.lookup_hits - before.lookup_hits == 23
    os.unlink(m.path / "pages" / "p05")
    assert store.prefix(names) == 5
    # fill the cache past its size: the oldest pages are evicted, and are then misses
    more = [f"q{i:03d}" for i in range(400)]
    assert all(store.write_many(more, lambda i: [page]))
    settled(m)
    gone = [n for n in names[:5] if not opens(m.path / "pages" / n)]
    assert gone, "nothing was evicted"
    assert store.prefix(names[:5]) == names[:5].index(gone[0])
    store.close()


def test_missing_subdirectories_are_absent_without_a_lookup(kvfs_mount):
    """vLLM's names (``abc/de_g0/<hash>.bin``): a new hash's subdirectory is usually missing
    too; the table answers for it (the kernel never sees a LOOKUP of it)."""
    m = kvfs_mount()
    table_ready(m)
    store = PageStore(m.path, "vllm")
    page = content("p", 4096)
    assert store.write_many(["abc/de_g0/abcde1.bin"], lambda i: [page]) == [True]
    view = NameView(str(m.path))
    d = str(m.path / "vllm")
    assert not view.absent_in(d, "abc/de_g0/abcde1.bin")
    assert view.absent_in(d, "abc/de_g0/abcde2.bin") and view.absent_in(d, "abc/ff_g0/abcff1.bin")
    assert view.absent_in(d, "fff/de_g0/fffde1.bin")
    assert store.prefix(["zzz/zz_g0/zzzzz.bin"]) == 0 and store.prefix(["abc/de_g0/abcde1.bin"]) == 1
    assert store.statistics().table_misses >= 1
    assert not view.absent_in(d, "../vllm/abc/de_g0/abcde1.bin")     # not plain: ask the mount
    store.close()


N_OLD = 2000       # entries there before the mount (one build step each)


def test_table_built_after_mount_is_exact_for_names_made_and_removed_meanwhile(kvfs_mount, tmp_path):
    """The table is built in the background after the mount is ready (one entry per step
    here): names created, renamed over and removed right after the mount (while it builds, if
    it still does: tests/store/test_names.py interleaves them deterministically) are right once
    it is advertised (its count is exact: no name it should not have), and a client that asks
    before falls back to lookups and still gets right answers."""
    cfg = tmp_path / "names.toml"
    cfg.write_text("[kvfs]\nnames_build_step = 1\n")
    m = kvfs_mount(config=str(cfg))
    d = m.path / "d"
    d.mkdir()
    for i in range(N_OLD):                       # one FUSE request each
        os.mkdir(d / f"o{i}")
    put(m.path / "pages" / "have", content("have", 4096))
    m.remount()
    store = PageStore(m.path, "pages")          # connects at once (before the table is built)
    assert store.prefix(["missing"]) == 0 and store.prefix(["have"]) == 1     # right either way
    if m.stats()["names"] is None:               # not advertised all along: it fell back
        assert store.statistics().table_misses == 0
    removed = [f"o{i}" for i in range(0, N_OLD, 97)]
    for n in removed:
        os.rmdir(d / n)
    made = [f"n{i}" for i in range(100)]
    for n in made:
        put(d / n, b"x")
    os.replace(d / "n0", d / "n1")               # renamed over: n0 goes, n1 stays
    st = table_ready(m)
    assert st["names"] == 1 + N_OLD - len(removed) + len(made) - 1 + 2      # d/*, "d", "pages", "have"
    view = NameView(str(m.path))
    assert all(view.absent_in(str(d), n) for n in removed) and view.absent_in(str(d), "n0")
    assert not any(view.absent_in(str(d), n) for n in made[1:])
    assert not any(view.absent_in(str(d), f"o{i}") for i in range(1, N_OLD, 97))
    assert not m.stats()["names_building"]
    store.close()
