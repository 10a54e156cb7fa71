"""Xattrs (kvfs/store/xattrs.py) on its own: user attributes kept in the index and the
read-only ``user.kvfs.*`` ones, with Owners and FileHandles' ``dirty`` as its collaborators."""
from __future__ import annotations

import errno
import json

import pytest

from kvfs.errors import NamespaceError
from kvfs.store import checksum
from kvfs.store.files import FileHandles
from kvfs.store.index import ROOT_INO
from kvfs.store.owners import Owners
from kvfs.store.xattrs import KV_PREFIX, XATTR_MAX, Xattrs
from support.store import open_parts


def build(index, store, ns, spill) -> tuple[FileHandles, Xattrs]:
    owners = Owners(index, store, ns)
    files = FileHandles(index, store, ns, spill, owners.grants_follow_setattr)
    ns.is_open = files.is_open
    return files, Xattrs(store, ns, owners, files.dirty)


async def test_user_attributes(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files, xattrs = build(index, store, ns, spill)
        fh, ino, _ = await files.create(ROOT_INO, b"f", 0o644, 0, 0)
        await files.release(fh)
        xattrs.set(ino, b"user.note", b"hello")
        assert xattrs.get(ino, b"user.note") == b"hello"
        assert b"user.note" in xattrs.names(ino) and KV_PREFIX + b"tier" in xattrs.names(ino)
        xattrs.remove(ino, b"user.note")
        assert xattrs.find(ino, b"user.note") is None
        with pytest.raises(NamespaceError) as e:
            xattrs.get(ino, b"user.note")
        assert e.value.errno == errno.ENODATA
        for name, value, err in ((b"trusted.x", b"1", errno.ENOTSUP), (KV_PREFIX + b"tier", b"x", errno.EPERM),
                                 (b"user.big", b"x" * (XATTR_MAX + 1), errno.E2BIG)):
            with pytest.raises(NamespaceError) as e:
                xattrs.set(ino, name, value)
            assert e.value.errno == err


async def test_kvfs_attributes_follow_the_object(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files, xattrs = build(index, store, ns, spill)
        fh, ino, _ = await files.create(ROOT_INO, b"f", 0o644, 0, 0)
        await files.write(fh, 0, b"z" * (1 << 20))
        assert xattrs.get(ino, KV_PREFIX + b"tier") == store.ram.name.encode()    # being written
        await files.release(fh)
        obj = ns.sealed[ino]
        assert xattrs.get(ino, KV_PREFIX + b"checksum") == checksum.hexdigest(obj.checksum).encode()
        assert xattrs.get(ino, KV_PREFIX + b"pin") == b"0"
        xattrs.set(ino, KV_PREFIX + b"pin", b"1")
        assert obj.pinned and xattrs.get(ino, KV_PREFIX + b"pin") == b"1"
        backing = json.loads(xattrs.get(ino, KV_PREFIX + b"backing"))
        assert backing["tier"] == store.ram.name and backing["size"] == obj.size
        await store.mover.demote(obj, 0)
        assert xattrs.get(ino, KV_PREFIX + b"tier") == store.tiers[1].name.encode()
