"""A start after a crash from the durable sets and running totals (kvfs.store.tally) ends in
exactly the state a full recovery (every record decoded) ends in, for random operation
sequences cut at random kill points; and an index written by an older kvfs (no ``recover``
database, no ``last_txn`` stamp) still recovers, through the full scan, and then keeps the
sets. Real tiers, real LMDB, no kernel.

The kill: after the operations, the index's state and NVMe directory are copied as they are
on the disk at that moment -- after the last group commit (``commit`` ops and the inline
commits put the boundaries; the changes still pending are what kill -9 loses) -- while files
may still be open and objects RAM-only. One copy starts as kvfs starts after a crash; the
other has its totals forgotten first (``tally.invalidate``), so it starts with the full
recovery. Both must show the same names, contents, records, sets and totals.
"""
from __future__ import annotations

import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import lmdb
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfs.build import fsck_layout
from kvfs.config import Config
from kvfs.errors import NamespaceError, StoreError
from kvfs.store import tally
from kvfs.store.fsck import run_fsck
from kvfs.store.index import ENV_NAME, ROOT_INO, Index
from support.store import block, hx, open_store, read_file as read, write_file as write

DIR = stat.S_IFDIR | 0o755
FILE = stat.S_IFREG | 0o644
DIRS = 3                                     # /a, /b (two namespaces) and /a/sub
NAMES = 5
RAM, NVME = 1 << 20, 8 << 20

_d, _n = st.integers(0, DIRS - 1), st.integers(0, NAMES - 1)
OPS = st.one_of(
    st.tuples(st.just("write"), _d, _n, st.sampled_from([0, 1, 3000, 70_000]), st.booleans()),
    st.tuples(st.just("unsealed"), _d, _n),
    st.tuples(st.just("open"), _d, _n),
    st.tuples(st.just("demote"), _d, _n),
    st.tuples(st.just("rename"), _d, _n, _d, _n),
    st.tuples(st.just("unlink"), _d, _n),
    st.tuples(st.just("kv"), _d, _n, st.integers(-1, NAMES - 1), st.booleans()),
    st.tuples(st.just("commit")),
)


async def _dirs(kvstore) -> list[int]:
    a = kvstore.index.lookup(ROOT_INO, b"a")
    if a is None:
        a, _ = kvstore.ns.make(ROOT_INO, b"a", DIR, 0, 0)
        kvstore.ns.make(ROOT_INO, b"b", DIR, 0, 0)
        kvstore.ns.make(a, b"sub", DIR, 0, 0)
    return [a, kvstore.index.lookup(ROOT_INO, b"b"), kvstore.index.lookup(a, b"sub")]


async def _apply(kvstore, dirs: list[int], op: tuple, seq: int) -> None:
    kind, name = op[0], lambda i: b"f%d" % i
    try:
        if kind == "write":
            await write(kvstore, dirs[op[1]], name(op[2]), bytes([seq % 251]) * op[3])
            if op[4]:
                obj = kvstore.ns.sealed.get(kvstore.ns.lookup(dirs[op[1]], name(op[2])))
                if obj is not None and obj.size:
                    await kvstore.store.mover.demote(obj, 0)
        elif kind == "kv":                  # a KV block naming its parent (-1: a head)
            head = op[3] < 0
            data = block("ns", hx(str(op[2])), "" if head else hx(str(op[3])), 16 if head else 32)
            await write(kvstore, dirs[op[1]], name(op[2]), data)
            if op[4]:
                await kvstore.store.mover.demote(kvstore.ns.sealed[kvstore.index.lookup(dirs[op[1]], name(op[2]))], 0)
        elif kind == "unsealed":            # created, never sealed (its writer went away)
            kvstore.ns.make(dirs[op[1]], name(op[2]), FILE, 0, 0, oid=None)
        elif kind == "open":                # being written at the kill
            fh, _ino, _ = await kvstore.files.create(dirs[op[1]], name(op[2]), 0o644, 0, 0)
            await kvstore.files.write(fh, 0, b"o" * (100 + seq))
        elif kind == "demote":
            obj = kvstore.ns.sealed.get(kvstore.ns.lookup(dirs[op[1]], name(op[2])))
            if obj is not None and obj.size and "ram" in obj.place:
                await kvstore.store.mover.demote(obj, 0)
        elif kind == "rename":
            await kvstore.names.rename(dirs[op[1]], name(op[2]), dirs[op[3]], name(op[4]), 0)
        elif kind == "unlink":
            await kvstore.names.unlink(dirs[op[1]], name(op[2]))
        else:
            kvstore.index.commit()
    except (NamespaceError, StoreError, KeyError):
        pass                                # a name that is not there (or open): no change


async def _state(kvstore) -> dict:
    """Everything the two starts must agree on."""
    tree = {}

    async def walk(d: int, path: bytes) -> None:
        for _e, n, ino, rec in list(kvstore.names.entries(d, 0)):
            if stat.S_ISDIR(rec.mode):
                tree[path + n] = "dir"
                await walk(ino, path + n + b"/")
            else:
                tree[path + n] = await read(kvstore, d, n)
    await walk(ROOT_INO, b"/")
    ix = kvstore.index
    ix.commit()
    inodes = {ino: (r.parent, r.name, r.oid, r.size) for ino, r in ix.iter_inodes()}
    objects = {oid: (r.ino, r.size, sorted(r.place)) for oid, r in ix.iter_objects()}
    with ix.env.begin() as t:
        sets = sorted(bytes(k) for k in t.cursor(db=ix.recover).iternext(values=False)
                      if k[:1] in (tally.UNSEALED, tally.RAM_ONLY))
    await kvstore.store.wait_loaded()         # the KV child counts: scanned, or known empty
    nvme = kvstore.store.tiers[1]
    t = kvstore.store.tally
    assert t.current() == t.recount(r for _o, r in ix.iter_objects())     # totals = records
    return dict(tree=tree, inodes=inodes, objects=objects, sets=sets, totals=t.current(),
                nvme=(nvme.used, nvme.objects), count=len(kvstore.store.objs),
                telemetry=kvstore.telemetry.totals(), kv=dict(kvstore.ns.prefix.children))


def _copy(src: Path, dst: Path) -> None:
    for part in ("state", "nvme"):
        shutil.copytree(src / part, dst / part, symlinks=True)


async def _crash_and_compare(ops: list[tuple], base: Path) -> dict:
    """The counts of the start from the sets (after checking it against the full one)."""
    orig, fast, full = base / "orig", base / "fast", base / "full"
    async with open_store(orig, ram=RAM, nvme=NVME) as kvstore:
        dirs = await _dirs(kvstore)
        kvstore.index.commit()
        for i, op in enumerate(ops):
            await _apply(kvstore, dirs, op, i)
        _copy(orig, fast)                   # kill -9 here: LMDB holds the last group commit
        _copy(orig, full)
    ix = Index(full / "state")
    tally.invalidate(ix)
    ix.close()
    async with open_store(fast, ram=RAM, nvme=NVME) as kvstore:
        got = kvstore.recovered
        assert "dangling_names" not in got, got                 # the sets, not the full scan
        assert got["decoded"] <= 3 * (got["dropped_files"] + got["lost_objects"])
        # no KV block ever written: the background scan skips the inodes (as after a clean
        # unmount); with one (committed or not), it may scan: the counts are compared below
        if not any(op[0] == "kv" for op in ops):
            assert not kvstore.store._scan_kv
        a = await _state(kvstore)
    async with open_store(full, ram=RAM, nvme=NVME) as kvstore:
        assert kvstore.store.table_loaded                         # the full recovery
        assert not kvstore.recovered["unowned_objects"]            # (its dangling names: those
                                                                # of the files it dropped)
        b = await _state(kvstore)
    assert a == b
    assert not a["sets"]                    # nothing unsealed or RAM-only is left after a start
    return {**got, "kv": a["kv"]}


@settings(max_examples=int(os.environ.get("KVFS_CRASH_EXAMPLES", "15")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=30))
def test_crash_start_from_the_sets_equals_the_full_recovery(ops):
    base = Path(tempfile.mkdtemp(prefix="kvfs-crash-equiv-"))
    try:
        trio.run(_crash_and_compare, ops, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


SCENARIOS = {                               # name: (ops, files dropped, objects lost)
    "unsealed file at the crash": ([("write", 0, 0, 3000, True), ("unsealed", 0, 1), ("open", 1, 2),
                                    ("commit",)], 2, 0),
    "RAM-only objects at the crash": ([("write", 0, 0, 3000, False), ("write", 2, 1, 70_000, False),
                                       ("write", 1, 1, 1, True), ("commit",)], 2, 2),
    "totals after deletes and moves": ([("write", 0, 0, 3000, True), ("write", 1, 1, 70_000, True),
                                        ("write", 0, 2, 0, True), ("rename", 0, 0, 1, 3),
                                        ("rename", 1, 1, 2, 0), ("unlink", 0, 2), ("commit",),
                                        ("write", 1, 4, 3000, True), ("rename", 1, 4, 1, 3)], 0, 0),
    "KV blocks at the crash": ([("kv", 0, 0, -1, True), ("kv", 0, 1, 0, True), ("kv", 1, 2, 0, False),
                                ("kv", 2, 3, 1, True), ("commit",)], 1, 1),
    "the last group lost": ([("write", 0, 0, 3000, True), ("commit",), ("unlink", 0, 0),
                             ("write", 1, 0, 3000, True)], 0, 0),
}


def test_crash_start_scenarios(tmp_path):
    for i, (name, (ops, dropped, lost)) in enumerate(SCENARIOS.items()):
        got = trio.run(_crash_and_compare, ops, tmp_path / str(i))
        assert (got["dropped_files"], got["lost_objects"]) == (dropped, lost), name
        if name.startswith("RAM"):          # per RAM-only file its object and inode records, once
            assert got["decoded"] == 2 * lost
        if name.startswith("KV"):           # f1 and f3 name parents and survive
            assert got["kv"] == {("ns", hx("0")): 1, ("ns", hx("1")): 1}


def _make_old(state: Path) -> None:
    """What an index of a kvfs before the sets looks like: no ``recover`` database and no
    ``last_txn`` stamp (raw LMDB, as that kvfs would have left it)."""
    env = lmdb.open(str(state / ENV_NAME), max_dbs=8, subdir=True, create=False)
    with env.begin(write=True) as t:
        t.drop(env.open_db(b"recover", txn=t), delete=True)
        t.delete(b"last_txn", db=env.open_db(b"meta", txn=t))
    env.close()


def test_an_index_of_an_older_kvfs_recovers_through_the_full_scan(tmp_path):
    ops = [("write", 0, 0, 3000, True), ("write", 1, 1, 70_000, True), ("write", 0, 3, 4000, False),
           ("unsealed", 2, 1), ("rename", 0, 0, 1, 2), ("commit",)]

    async def run():
        async with open_store(tmp_path, ram=RAM, nvme=NVME) as kvstore:
            dirs = await _dirs(kvstore)
            for i, op in enumerate(ops):
                await _apply(kvstore, dirs, op, i)
            kvstore.index.commit()
        _make_old(tmp_path / "state")
        async with open_store(tmp_path, ram=RAM, nvme=NVME) as kvstore:
            got = kvstore.recovered
            assert kvstore.store.table_loaded and "dangling_names" in got       # the full scan
            assert got["dropped_files"] == 2 and got["lost_objects"] == 1
            state = await _state(kvstore)
            assert set(state["tree"]) == {b"/a", b"/b", b"/a/sub", b"/b/f2", b"/b/f1"}
            assert state["tree"][b"/b/f2"] == bytes([0]) * 3000
            dirs = await _dirs(kvstore)       # the sets are kept from here on
            await _apply(kvstore, dirs, ("write", 2, 4, 5000, False), 9)
            await _apply(kvstore, dirs, ("unsealed", 0, 4), 10)
            kvstore.index.commit()
        async with open_store(tmp_path, ram=RAM, nvme=NVME) as kvstore:
            got = kvstore.recovered
            assert "dangling_names" not in got and not kvstore.store.table_loaded
            assert got["dropped_files"] == 2 and got["lost_objects"] == 1 and got["decoded"] <= 6
            after = await _state(kvstore)
            assert after["tree"] == state["tree"] and after["totals"] == state["totals"]
    trio.run(run)


def _forge(state: Path, key: bytes, a: int, b: int) -> None:
    """Set a running total through kvfs's own write path (stamped: not a write behind its
    back), as a bug in a writer that skipped the tally would leave it."""
    ix = Index(state)
    with ix.write() as txn:
        txn.recover_set(key, struct.pack(">qq", a, b))
    ix.close()


def test_totals_that_disagree_with_the_index_make_the_start_recover_in_full(tmp_path):
    ops = [("write", 0, 0, 3000, True), ("write", 1, 1, 70_000, True), ("write", 0, 3, 4000, False),
           ("unsealed", 2, 1), ("commit",)]
    objects = tally.OBJECTS
    for i, (key, a, b) in enumerate([(objects, 7, 0),                 # the object count
                                     (tally.NAMESPACE + b"a", 3000, 5),   # a namespace's count
                                     (tally.TIER + b"nvme", -4096, 0)]):    # a negative total
        base = tmp_path / str(i)

        async def run():
            async with open_store(base, ram=RAM, nvme=NVME) as kvstore:
                dirs = await _dirs(kvstore)
                for j, op in enumerate(ops):
                    await _apply(kvstore, dirs, op, j)
                kvstore.index.commit()
            _forge(base / "state", key, a, b)
            async with open_store(base, ram=RAM, nvme=NVME) as kvstore:
                got = kvstore.recovered
                assert kvstore.store.table_loaded and "dangling_names" in got, key    # in full
                assert got["dropped_files"] == 2 and got["lost_objects"] == 1
                state = await _state(kvstore)                     # totals recounted
                assert state["count"] == 2 and state["totals"][objects] == [2, 0]
                assert state["nvme"][1] == 2
        trio.run(run)


def test_fsck_reports_a_kv_parent_the_index_says_none_has(tmp_path):
    async def build():
        async with open_store(tmp_path, ram=RAM, nvme=NVME, clean=True) as kvstore:
            dirs = await _dirs(kvstore)
            await _apply(kvstore, dirs, ("kv", 0, 1, 0, True), 0)
    trio.run(build)
    cfg = Config(nvme=str(tmp_path / "nvme"), state=str(tmp_path / "state"), nvme_size="8MiB")
    assert run_fsck(fsck_layout(cfg)).problems == []
    ix = Index(tmp_path / "state")          # what a writer that skipped put_inode's hook leaves
    with ix.write() as txn:
        txn.recover_set(tally.NO_KV, b"")
    ix.close()
    report = run_fsck(fsck_layout(cfg), repair=True)
    assert len(report.problems) == 1 and "has a KV parent" in report.problems[0]
    assert run_fsck(fsck_layout(cfg)).problems == []     # forgotten: the next start recovers in full

    async def start():
        async with open_store(tmp_path, ram=RAM, nvme=NVME) as kvstore:
            assert kvstore.store.table_loaded and kvstore.ns.prefix.children == {("ns", hx("0")): 1}
            assert not kvstore.store.tally.no_kv
    trio.run(start)


def test_a_clean_unmount_notes_that_no_kv_parent_exists_for_the_next_crash_start(tmp_path):
    async def run():
        async with open_store(tmp_path, ram=RAM, nvme=NVME) as kvstore:
            dirs = await _dirs(kvstore)
            await _apply(kvstore, dirs, ("write", 0, 0, 3000, True), 0)
            await _apply(kvstore, dirs, ("kv", 1, 1, -1, True), 1)       # a head: no parent
        ix = Index(tmp_path / "state")      # as an index from before the key leaves it
        with ix.write() as txn:
            txn.recover_set(tally.NO_KV, None)
        ix.close()
        async with open_store(tmp_path, ram=RAM, nvme=NVME, clean=True) as kvstore:
            assert "dangling_names" not in kvstore.recovered and kvstore.store._scan_kv
            await kvstore.store.wait_loaded()             # the scan finds no KV child
        async with open_store(tmp_path, ram=RAM, nvme=NVME) as kvstore:
            assert kvstore.recovered == {"clean": 1}
        async with open_store(tmp_path, ram=RAM, nvme=NVME) as kvstore:
            assert "dangling_names" not in kvstore.recovered and not kvstore.store._scan_kv
            await _apply(kvstore, await _dirs(kvstore), ("kv", 0, 2, 1, True), 2)
            kvstore.index.commit()
        async with open_store(tmp_path, ram=RAM, nvme=NVME) as kvstore:
            assert kvstore.store._scan_kv                 # a child was written since
            await kvstore.store.wait_loaded()
            assert kvstore.ns.prefix.children == {("ns", hx("1")): 1}
    trio.run(run)
