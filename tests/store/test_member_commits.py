"""Commits (kvfs/store/commit.py) on its own: publishing bytes a caller hands over by
descriptor, with FileHandles (a temp file's handle under a quota) and NameOps (its rename)
as its collaborators, over a real index, object store and namespace. The quota path (temp
file, seal, rename) needs kvfs.quota over a whole Store: test_commit_quota_handles.py."""
from __future__ import annotations

import errno
import os
import stat

import pytest

from kvfs.errors import NamespaceError
from kvfs.store.caller import CallerFile
from kvfs.store.commit import Commits, CommitEntry
from kvfs.store.cred import ROOT, Cred
from kvfs.store.files import FileHandles
from kvfs.store.index import ROOT_INO
from kvfs.store.nameops import NameOps
from kvfs.store.owners import Owners
from support.store import open_parts


def build(index, store, ns, spill) -> tuple[FileHandles, Commits]:
    owners = Owners(index, store, ns)
    files = FileHandles(index, store, ns, spill, owners.grants_follow_setattr)
    ns.is_open = files.is_open
    names = NameOps(index, store, ns, files.is_open, owners.grants_follow_rename)
    return files, Commits(index, store, ns, files, names, spill)


async def read(files: FileHandles, ino: int) -> bytes:
    fh = await files.open(ino, os.O_RDONLY)
    try:
        return bytes(await files.read(fh, 0, 1 << 22))
    finally:
        await files.release(fh)


async def test_entries_are_published_each_on_its_own(tmp_path):
    src = tmp_path / "src"
    body = os.urandom(3 << 20)
    src.write_bytes(body)
    fd = os.open(src, os.O_RDONLY)
    try:
        async with open_parts(tmp_path) as (index, store, ns, spill):
            files, commits = build(index, store, ns, spill)
            seen = []

            async def hook(parent, name):
                seen.append(name)
            commits.on_renamed = hook
            entries = [CommitEntry(b"d/a", CallerFile(fd), 0, 1 << 20),
                       CommitEntry(b"d/b", CallerFile(fd), 1 << 20, 2 << 20),
                       CommitEntry(b"d/c", CallerFile(fd), 3 << 20, 10)]     # past the end
            done = await commits.commit_entries(entries, ROOT, dirmode=0o755)
            d = ns.find(ROOT_INO, b"d")
            assert done[:2] == [(d, b"a"), (d, b"b")]
            assert isinstance(done[2], NamespaceError) and done[2].errno == errno.EINVAL
            assert await read(files, ns.find(d, b"a")) == body[:1 << 20]
            assert await read(files, ns.find(d, b"b")) == body[1 << 20:]
            assert ns.find(d, b"c") is None and seen == [b"a", b"b"]
            assert files.handles == {}
    finally:
        os.close(fd)


async def test_the_parent_is_checked_as_the_caller(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        _, commits = build(index, store, ns, spill)
        d, _ = ns.make(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
        assert commits.commit_parent(b"d/x", ROOT) == (d, b"x")
        for path, cred, kw, err in ((b"d/x", Cred(1000, 1000), {}, errno.EACCES),
                                    (b"e/x", ROOT, {}, errno.ENOENT),
                                    (b"d/../x", ROOT, {}, errno.EINVAL),
                                    (b"d", ROOT, {"noreplace": True}, errno.EEXIST),
                                    (b"d", ROOT, {}, errno.EISDIR)):
            with pytest.raises(NamespaceError) as e:
                commits.commit_parent(path, cred, **kw)
            assert e.value.errno == err, path
        made: list = []
        parent, name = commits.commit_parent(b"d/e/f/x", ROOT, dirmode=0o750, made=made)
        assert name == b"x" and made == [(d, b"e"), (ns.find(d, b"e"), b"f")]
        assert ns.inode(parent).mode & 0o7777 == 0o750
