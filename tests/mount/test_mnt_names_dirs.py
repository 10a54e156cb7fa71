"""Cached directory inodes of the name table (issue 13, "exists >= 1.0x"): PageStore answers a
miss with no system call once it has the page directory's inode, and that inode is never
trusted past the change that makes it wrong -- a directory removed and made again, renamed
away, replaced by a rename over it (the table's H_DIRS word), or a daemon killed and another
mounted at the same path (its successor marks the old table stale). Through a real mount.

The stores here keep a cached inode for as long as the table vouches for it
(``revalidate=None``): the once-a-second ``stat`` of the default would hide a missing
invalidation when a step is slow."""
from __future__ import annotations

import os
import shutil

import pytest

from support.files import content, put, read
from support.mount import wait_for

from kvfs.integrations.pages import PageStore

pytestmark = pytest.mark.mount

PAGE = content("page", 4096)


def table_ready(m) -> dict:
    """Wait for the daemon to advertise its name table (built in the background after mount)."""
    return wait_for(lambda: m.stats()["names"], 120, "the name table")


def cached(store: PageStore, subdir: str = "") -> None:
    """Misses until the store answers from a cached inode (no stat): the steady state."""
    for _ in range(3):      # connect, map the table, cache the inode: a stat each at most
        assert store.prefix([f"{subdir}warm-miss"]) == 0
    n = store.statistics().table_stats
    assert store.prefix([f"{subdir}steady-miss"]) == 0 and store.statistics().table_stats == n


def warm_reader(kvfs_mount, subdir: str = "pages"):
    """A mount with its name table, page ``p0`` in ``subdir``, and a store on ``subdir``
    answering misses from its cached inode."""
    m = kvfs_mount()
    table_ready(m)
    reader = PageStore(m.path, subdir, revalidate=None)
    put(m.path / subdir / "p0", PAGE)
    cached(reader)
    return m, reader


def test_directory_removed_and_made_again_is_not_answered_from_its_old_inode(kvfs_mount):
    m = kvfs_mount()
    table_ready(m)
    reader = PageStore(m.path, "pages", revalidate=None)
    writer = PageStore(m.path, "pages")
    assert writer.write_many(["p0"], lambda i: [PAGE]) == [True]
    cached(reader)
    dirs = m.stats()["names"]["dirs_removed"]
    os.unlink(m.path / "pages" / "p0")                  # files going do not move H_DIRS
    assert reader.prefix(["p0"]) == 0
    assert m.stats()["names"]["dirs_removed"] == dirs
    os.rmdir(m.path / "pages")
    os.mkdir(m.path / "pages")                          # same name, another inode
    put(m.path / "pages" / "p1", PAGE)
    assert reader.prefix(["p1"]) == 1                   # not "absent" through the old inode
    assert m.stats()["names"]["dirs_removed"] == dirs + 1
    assert reader.prefix(["p2"]) == 0
    assert reader.statistics().table_misses >= 4
    reader.close()
    writer.close()


def test_directory_renamed_away_and_another_over_its_name(kvfs_mount):
    m, reader = warm_reader(kvfs_mount)
    os.rename(m.path / "pages", m.path / "old")        # renamed away ...
    os.mkdir(m.path / "next")
    put(m.path / "next" / "p1", PAGE)
    os.rename(m.path / "next", m.path / "pages")       # ... and another in its place
    assert reader.prefix(["p1"]) == 1 and reader.prefix(["p0"]) == 0
    cached(reader)
    os.unlink(m.path / "pages" / "p1")
    os.mkdir(m.path / "fresh")
    put(m.path / "fresh" / "p2", PAGE)
    os.rename(m.path / "fresh", m.path / "pages")      # over the (empty) directory
    assert reader.prefix(["p2"]) == 1 and reader.prefix(["p1"]) == 0
    # an ancestor renamed: the page directory's own entry never changed
    deep = PageStore(m.path, "model/pages", revalidate=None)
    put(m.path / "model" / "pages" / "d0", PAGE)
    cached(deep)
    os.rename(m.path / "model", m.path / "model.old")
    put(m.path / "model" / "pages" / "d1", PAGE)
    assert deep.prefix(["d1"]) == 1 and deep.prefix(["d0"]) == 0
    reader.close()
    deep.close()


def test_subdirectories_of_names_removed_and_made_again(kvfs_mount):
    """vLLM's ``abc/de_g0/<hash>.bin``: the subdirectories' inodes are cached too."""
    m = kvfs_mount()
    table_ready(m)
    reader = PageStore(m.path, "vllm", revalidate=None)
    writer = PageStore(m.path, "vllm")
    assert writer.write_many(["abc/de_g0/h0.bin"], lambda i: [PAGE]) == [True]
    cached(reader, "abc/de_g0/")
    shutil.rmtree(m.path / "vllm" / "abc")
    assert writer.write_many(["abc/de_g0/h1.bin"], lambda i: [PAGE]) == [True]
    assert reader.prefix(["abc/de_g0/h1.bin"]) == 1 and reader.prefix(["abc/de_g0/h0.bin"]) == 0
    assert reader.prefix(["abc/ff_g0/h2.bin"]) == 0
    reader.close()
    writer.close()


def test_killed_daemon_and_a_new_mount_at_the_same_path(kvfs_mount):
    m, reader = warm_reader(kvfs_mount)
    m.kill9()                           # its table stays mapped in the reader, never marked stale
    assert reader.prefix(["p2"]) == 0                   # a dead mount: misses, no exception
    m.mount()                           # (only misses asked meanwhile: nothing made it reconnect)
    table_ready(m)
    put(m.path / "pages" / "p1", PAGE)                  # a page of the new run
    assert reader.prefix(["p1"]) == 1                   # found: not the old table's "absent"
    assert reader.prefix(["p0"]) == int(os.path.exists(m.path / "pages" / "p0"))   # RAM only: lost
    assert reader.prefix(["p2"]) == 0
    cached(reader)                      # the new run's table answers misses again
    assert read(m.path / "pages" / "p1") == PAGE
    reader.close()


def test_no_stat_per_miss_in_the_steady_state(kvfs_mount):
    m = kvfs_mount()
    table_ready(m)
    store = PageStore(m.path, "pages", revalidate=None)
    assert store.write_many(["have"], lambda i: [PAGE]) == [True]
    cached(store)
    before = store.statistics()
    for i in range(1000):
        assert store.prefix([f"miss{i}"]) == 0
    after = store.statistics()
    assert after.table_misses - before.table_misses == 1000
    assert after.table_stats == before.table_stats      # 0 stats per miss
    assert after.reconnects == before.reconnects and after.errors == before.errors
    store.close()
    # the default re-stats the directory at most every second (a remount the table cannot
    # see): far fewer stats than misses
    store = PageStore(m.path, "pages")
    for i in range(1000):
        assert store.prefix([f"miss{i}"]) == 0
    assert store.statistics().table_misses == 1000 and store.statistics().table_stats < 100
    store.close()
