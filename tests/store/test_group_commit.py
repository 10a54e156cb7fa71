"""Group commits of the index: operations are served from memory at once and reach LMDB
together, in one write transaction; a durable copy is freed only after the commit that
dropped its record; fsync commits. Real LMDB, real tiers, no kernel."""
from __future__ import annotations

import errno
import os
import stat

import pytest
import trio

from kvfs.errors import NamespaceError
from kvfs.store.index import DIRENTS, ROOT_INO, k64
from support.store import open_store

DIR = stat.S_IFDIR | 0o755
FILE = stat.S_IFREG | 0o644


def in_lmdb(index, db, key: bytes) -> bool:
    """Whether ``key`` is in LMDB itself (what a kill -9 leaves), pending changes aside."""
    with index.env.begin() as txn:
        return txn.get(key, db=db) is not None


async def write_file(kvstore, parent: int, name: bytes, data: bytes, *, fsync: bool = False) -> int:
    fh, ino, _ = await kvstore.files.create(parent, name, 0o644, 0, 0)
    await kvstore.files.write(fh, 0, data)
    if fsync:
        await kvstore.files.fsync(fh)
    await kvstore.files.release(fh)
    return ino


def test_operations_are_served_from_memory_and_committed_in_one_transaction(tmp_path):
    async def main():
        async with open_store(tmp_path) as kvstore:
            ix, ns = kvstore.index, kvstore.ns
            ix.commit()
            before = ix.commits
            d, _ = ns.make(ROOT_INO, b"d", DIR, 0, 0)
            files = [ns.make(d, f"f{i}".encode(), FILE, 0, 0, oid=None)[0] for i in range(20)]
            ns.rename(d, b"f0", d, b"g0", 0, kvstore.files.is_open)
            assert ix.pending == 22
            assert ns.lookup(d, b"g0") == files[0] and ns.inode(files[0]).name == b"g0"
            assert not in_lmdb(ix, ix.dirents, k64(d) + b"g0")
            assert not in_lmdb(ix, ix.inodes, k64(files[5]))
            ix.commit()
            assert ix.commits == before + 1 and ix.pending == 0
            assert in_lmdb(ix, ix.dirents, k64(d) + b"g0") and not in_lmdb(ix, ix.dirents, k64(d) + b"f0")
            assert all(in_lmdb(ix, ix.inodes, k64(f)) for f in files)
    trio.run(main)


def test_a_failed_operation_leaves_nothing_pending(tmp_path):
    async def main():
        async with open_store(tmp_path) as kvstore:
            ix, ns = kvstore.index, kvstore.ns
            d, _ = ns.make(ROOT_INO, b"d", DIR, 0, 0)
            f, _ = ns.make(d, b"f", FILE, 0, 0, oid=None)
            ix.commit()
            with pytest.raises(NamespaceError) as e:
                ns.make(d, b"f", FILE, 0, 0, oid=None)
            assert e.value.errno == errno.EEXIST
            with pytest.raises(NamespaceError) as e:
                ns.rename(d, b"f", f, b"x", 0, kvstore.files.is_open)      # into a file
            assert e.value.errno == errno.ENOTDIR
            assert ix.pending == 0
            assert ns.lookup(d, b"f") == f
    trio.run(main)


def test_range_reads_and_rmdir_see_the_pending_changes(tmp_path):
    async def main():
        async with open_store(tmp_path) as kvstore:
            ix, ns = kvstore.index, kvstore.ns
            d, _ = ns.make(ROOT_INO, b"d", DIR, 0, 0)
            ns.make(d, b"a", FILE, 0, 0, oid=None)
            ns.make(d, b"b", FILE, 0, 0, oid=None)
            assert [n for _, n, _ in ix.readdir(d, 0)] == [b"a", b"b"]
            ns.make(d, b"c", FILE, 0, 0, oid=None)               # pending again
            with pytest.raises(NamespaceError) as e:
                ns.rmdir(ROOT_INO, b"d")
            assert e.value.errno == errno.ENOTEMPTY
            for n in (b"a", b"b", b"c"):
                await kvstore.names.unlink(d, n)
            ns.rmdir(ROOT_INO, b"d")                                 # empty, though not committed
            assert ix.pending and [n for _, n, _ in ix.readdir(ROOT_INO, 0)] == []
            assert ix.counts()["inodes"] == 1 and ix.pending == 0
    trio.run(main)


def test_lookups_of_names_read_from_lmdb_follow_every_later_change(tmp_path):
    """A name read from LMDB is kept for the next lookups (no read transaction); a rename,
    unlink or rename over it is seen at once, pending or committed."""
    async def main():
        async with open_store(tmp_path) as kvstore:
            ix, ns = kvstore.index, kvstore.ns
            d, _ = ns.make(ROOT_INO, b"d", DIR, 0, 0)
            a, _ = ns.make(d, b"a", FILE, 0, 0, oid=None)
            b, _ = ns.make(d, b"b", FILE, 0, 0, oid=None)
            ix.commit()
            assert (ix.lookup(d, b"a"), ix.lookup(d, b"a"), ix.lookup(d, b"b")) == (a, a, b)
            ns.rename(d, b"a", d, b"b", 0, kvstore.files.is_open)    # over b, pending
            assert (ix.lookup(d, b"a"), ix.lookup(d, b"b")) == (None, a)
            ix.commit()
            assert (ix.lookup(d, b"a"), ix.lookup(d, b"b")) == (None, a)
            await kvstore.names.unlink(d, b"b")
            assert ix.lookup(d, b"b") is None
            c, _ = ns.make(d, b"b", FILE, 0, 0, oid=None)
            assert ix.lookup(d, b"b") == c
            ix.commit()
            assert ix.lookup(d, b"b") == c and ix.lookup(d, b"a") is None
    trio.run(main)


def test_a_durable_copy_is_freed_only_after_the_commit_that_dropped_it(tmp_path):
    """Unlink and rename over a file whose bytes are on NVMe: when its copy is deleted, LMDB
    no longer has the record (a kill -9 then finds the file absent, never unreadable)."""
    async def main():
        async with open_store(tmp_path) as kvstore:
            ix, store = kvstore.index, kvstore.store
            nvme = store.tiers[1]
            seen = []
            real_delete = nvme.delete

            async def delete(oid, loc):
                seen.append((oid, in_lmdb(ix, ix.objects, k64(oid))))
                await real_delete(oid, loc)
            nvme.delete = delete
            victims = []
            for name in (b"gone", b"over"):
                ino = await write_file(kvstore, ROOT_INO, name, os.urandom(70_000))
                obj = kvstore.ns.sealed[ino]
                await store.mover.demote(obj, 0)
                assert set(obj.place) == {"nvme"}
                victims.append(obj.oid)
            ix.commit()
            await kvstore.names.unlink(ROOT_INO, b"gone")
            await write_file(kvstore, ROOT_INO, b"new", b"x" * 10)
            await kvstore.names.rename(ROOT_INO, b"new", ROOT_INO, b"over", 0)
            assert seen == [(victims[0], False), (victims[1], False)]
    trio.run(main)


def test_fsync_puts_the_sealed_record_in_lmdb(tmp_path):
    async def main():
        async with open_store(tmp_path) as kvstore:
            ix = kvstore.index
            ino = await write_file(kvstore, ROOT_INO, b"f", b"y" * 5000, fsync=True)
            oid = kvstore.ns.sealed[ino].oid
            assert ix.pending == 0
            assert in_lmdb(ix, ix.objects, k64(oid)) and in_lmdb(ix, ix.dirents, k64(ROOT_INO) + b"f")
            with ix.env.begin() as txn:
                from kvfs.store.records import decode_inode
                assert decode_inode(txn.get(k64(ino), db=ix.inodes)).oid == oid
    trio.run(main)


def test_reopen_after_close_keeps_every_operation(tmp_path):
    async def main():
        async with open_store(tmp_path) as kvstore:
            for i in range(50):
                await write_file(kvstore, ROOT_INO, f"f{i}".encode(), bytes([i]) * 3000)
            assert kvstore.index.pending
            await kvstore.store.mover.write_down_volatile()      # the unmount's write-down (one sync)
        async with open_store(tmp_path) as kvstore:
            names = sorted(n for _, n, _ in kvstore.index.readdir(ROOT_INO, 0))
            assert names == sorted(f"f{i}".encode() for i in range(50))
            for i in range(50):
                fh = await kvstore.files.open(kvstore.ns.lookup(ROOT_INO, f"f{i}".encode()), os.O_RDONLY)
                assert bytes(await kvstore.files.read(fh, 0, 4000)) == bytes([i]) * 3000
                await kvstore.files.release(fh)
    trio.run(main)


def test_a_name_made_and_removed_within_one_group_never_reaches_lmdb(tmp_path):
    """A temp name renamed away in the group that made it is dropped from the group (no LMDB
    delete); a name LMDB already holds is still deleted there, also when it is made again
    and removed again within the next group."""
    async def main():
        async with open_store(tmp_path) as kvstore:
            ix, ns = kvstore.index, kvstore.ns
            d, _ = ns.make(ROOT_INO, b"d", DIR, 0, 0)
            ix.commit()
            ino = ns.make(d, b".t.tmp", FILE, 0, 0, oid=None)[0]
            ns.rename(d, b".t.tmp", d, b"t", 0, kvstore.files.is_open)
            assert (DIRENTS, k64(d) + b".t.tmp") not in ix._pending     # nothing to delete in LMDB
            assert ns.find(d, b".t.tmp") is None and ns.lookup(d, b"t") == ino
            kept = ns.make(d, b"kept", FILE, 0, 0, oid=None)[0]
            ix.commit()
            assert in_lmdb(ix, ix.dirents, k64(d) + b"t") and in_lmdb(ix, ix.dirents, k64(d) + b"kept")
            assert not in_lmdb(ix, ix.dirents, k64(d) + b".t.tmp")
            assert [n for _e, n, _i in ix.readdir(d, 0)] == [b"t", b"kept"]
            # in LMDB now: unlinked, made again and renamed away in one group -> deleted in LMDB
            ns.unlink(d, b"kept", kvstore.files.is_open)
            again = ns.make(d, b"kept", FILE, 0, 0, oid=None)[0]
            ns.rename(d, b"kept", d, b"moved", 0, kvstore.files.is_open)
            ix.commit()
            assert not in_lmdb(ix, ix.dirents, k64(d) + b"kept")
            assert ns.lookup(d, b"moved") == again and ns.find(d, b"kept") is None
            assert sorted(n for _e, n, _i in ix.readdir(d, 0)) == [b"moved", b"t"]
            assert kept != again
    trio.run(main)
