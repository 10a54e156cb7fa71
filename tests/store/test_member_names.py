"""NameOps (kvfs/store/nameops.py) on its own: lookups, directories, and the unlink and rename
that free bytes, over a real index, object store and namespace; FileHandles makes the files."""
from __future__ import annotations

import errno
import os
import stat

import pytest

from kvfs.errors import NamespaceError
from kvfs.store.files import FileHandles
from kvfs.store.index import ROOT_INO
from kvfs.store.nameops import NameOps
from kvfs.store.owners import Owners
from support.store import open_parts


def build(index, store, ns, spill) -> tuple[FileHandles, NameOps]:
    owners = Owners(index, store, ns)
    files = FileHandles(index, store, ns, spill, owners.grants_follow_setattr)
    ns.is_open = files.is_open
    return files, NameOps(index, store, ns, files.is_open, owners.grants_follow_rename)


async def sealed(files: FileHandles, parent: int, name: bytes, data: bytes) -> int:
    fh, ino, _ = await files.create(parent, name, 0o644, 0, 0)
    await files.write(fh, 0, data)
    await files.release(fh)
    return ino


async def test_directories_and_lookups(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files, names = build(index, store, ns, spill)
        d, rec = names.make(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
        assert stat.S_ISDIR(rec.mode) and names.find(ROOT_INO, b"d") == d
        assert names.find(ROOT_INO, b"nope") is None
        ino = await sealed(files, d, b"f", b"abc")
        assert [(n, i) for _, n, i, _ in names.entries(d, 0)] == [(b"f", ino)]
        assert names.top_of(ino) == "d" and names.inode(ino).size == 3
        assert names.inode_count() == 3             # root, d, f
        with pytest.raises(NamespaceError) as e:
            names.rmdir(ROOT_INO, b"d")
        assert e.value.errno == errno.ENOTEMPTY


async def test_unlink_frees_the_bytes_and_tells_what_went(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files, names = build(index, store, ns, spill)
        ino = await sealed(files, ROOT_INO, b"f", b"x" * 8192)
        obj = ns.sealed[ino]
        assert names.describe(obj) == ("/f", None)
        used = store.ram.used
        await names.unlink(ROOT_INO, b"f")
        assert names.find(ROOT_INO, b"f") is None and names.dropped(ino)
        assert obj.dead and store.ram.used < used


async def test_rename_over_a_file_releases_it_and_calls_the_hook(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files, names = build(index, store, ns, spill)
        seen = []

        async def hook(parent, name):
            seen.append((parent, name))
        names.on_renamed = hook
        a = await sealed(files, ROOT_INO, b"a", b"new")
        b = await sealed(files, ROOT_INO, b"b", b"old")
        old = ns.sealed[b]
        await names.rename(ROOT_INO, b"a", ROOT_INO, b"b", 0)
        assert names.find(ROOT_INO, b"b") == a and names.find(ROOT_INO, b"a") is None
        assert old.dead and seen == [(ROOT_INO, b"b")]


async def test_renew_gives_the_name_a_new_inode_and_keeps_the_reader(tmp_path):
    """A held file's rewrite (kvfs/fs/opens.py ``Opens.changeable``): the name gets a new inode with
    the same sealed version, record and xattrs in one transaction; the open descriptor keeps
    the old inode as an orphan, reads its version, and its space stays counted until it goes."""
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files, names = build(index, store, ns, spill)
        data = b"v1" * 100_000
        ino = await sealed(files, ROOT_INO, b"f", data)
        ns.set_user_xattr(ino, b"user.k", b"v")
        obj = ns.sealed[ino]
        assert names.renew(ino) is None                     # nobody has it open: nothing to keep
        fh = await files.open(ino, 0)
        parent, name, new = names.renew(ino)
        assert (parent, name) == (ROOT_INO, b"f") and new != ino
        assert names.find(ROOT_INO, b"f") == new and index.get_inode(ino) is None
        rec, was = index.get_inode(new), names.inode(ino)
        assert rec.oid == obj.oid and rec.xattrs == {b"user.k": b"v"} and rec.nlink == 1
        assert (rec.mode, rec.uid, rec.size, rec.mtime) == (was.mode, was.uid, was.size, was.mtime)
        assert was.nlink == 0 and names.evicted(ino) and names.dropped(ino)
        assert obj.ino == new and index.get_object(obj.oid).ino == new and ns.sealed[new] is obj
        assert names.renew(ino) is None                     # an orphan has no name to give
        assert bytes(await files.read(fh, 0, len(data) + 1)) == data
        w = await files.open(new, os.O_WRONLY | os.O_TRUNC)  # the retried rewrite
        await files.write(w, 0, b"v2")
        await files.release(w)
        assert obj.dead and obj.refs == 1 and bytes(await files.read(fh, 0, len(data) + 1)) == data
        used = store.ram.used
        await files.release(fh)
        assert ino not in ns.orphans and not names.evicted(ino)
        assert store.ram.used <= used - len(data)
        fh = await files.open(new, 0)
        assert bytes(await files.read(fh, 0, 10)) == b"v2"
        await files.release(fh)
