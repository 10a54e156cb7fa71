"""NameOps (kvfs/store/nameops.py) on its own: lookups, directories, and the unlink and rename
that free bytes, over a real index, object store and namespace; FileHandles makes the files."""
from __future__ import annotations

import errno
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
