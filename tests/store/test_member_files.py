"""FileHandles (kvfs/store/files.py) on its own: built from a real index, object store and
namespace, with Owners' grant rule as its one collaborator."""
from __future__ import annotations

import os
import stat

from kvfs.store.files import FileHandles
from kvfs.store.index import ROOT_INO
from kvfs.store.owners import Owners
from support.store import open_parts


def files_over(index, store, ns, spill) -> FileHandles:
    files = FileHandles(index, store, ns, spill, Owners(index, store, ns).grants_follow_setattr)
    ns.is_open = files.is_open
    return files


async def test_write_seal_and_read_back(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files = files_over(index, store, ns, spill)
        sealed = []
        files.on_sealed = lambda ino, serial, oid: sealed.append((ino, oid))
        data = os.urandom(100_000)
        fh, ino, rec = await files.create(ROOT_INO, b"f", 0o644, 0, 0)
        assert stat.S_ISREG(rec.mode) and files.is_open(ino)
        await files.write(fh, 0, data)
        assert files.dirty(ino) and files.getattr(ino).size == len(data)
        await files.release(fh)
        assert not files.is_open(ino) and not files.dirty(ino) and files.open_handles() == 0
        assert sealed == [(ino, index.get_inode(ino).oid)]
        fh = await files.open(ino, os.O_RDONLY)
        assert bytes(await files.read(fh, 0, 1 << 20)) == data
        assert bytes(await files.read(fh, 99_990, 100)) == data[99_990:]
        await files.release(fh)
        assert files.handles == {} and files.writers == {}


async def test_truncate_by_setattr_seals_a_new_version(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files = files_over(index, store, ns, spill)
        fh, ino, _ = await files.create(ROOT_INO, b"f", 0o644, 0, 0)
        await files.write(fh, 0, b"x" * 5000)
        await files.release(fh)
        old = index.get_inode(ino).oid
        rec = await files.setattr(ino, size=1000, mode=0o600)
        assert rec.size == 1000 and rec.mode & 0o7777 == 0o600
        assert index.get_inode(ino).oid != old
        fh = await files.open(ino, os.O_RDONLY)
        assert bytes(await files.read(fh, 0, 8192)) == b"x" * 1000
        await files.release(fh)


async def test_a_reader_keeps_its_version_while_a_writer_seals_another(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        files = files_over(index, store, ns, spill)
        fh, ino, _ = await files.create(ROOT_INO, b"f", 0o644, 0, 0)
        await files.write(fh, 0, b"a" * 4096)
        await files.release(fh)
        reader = await files.open(ino, os.O_RDONLY)
        writer = await files.open(ino, os.O_WRONLY | os.O_TRUNC)
        await files.write(writer, 0, b"b" * 4096)
        await files.flush(writer)
        await files.release(writer)
        assert bytes(await files.read(reader, 0, 4096)) == b"a" * 4096
        await files.release(reader)
        fh = await files.open(ino, os.O_RDONLY)
        assert bytes(await files.read(fh, 0, 4096)) == b"b" * 4096
        await files.release(fh)
