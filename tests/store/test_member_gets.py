"""BatchGets (kvfs/store/getbatch.py) on its own: many small files' bytes in one answer, over a
real object store, with Leases' prefix lookup as its one collaborator."""
from __future__ import annotations

import errno
import os

import xxhash

from kvfs import protocol
from kvfs.store.files import FileHandles
from kvfs.store.getbatch import BatchGets
from kvfs.store.index import ROOT_INO
from kvfs.store.leases import Leases
from kvfs.store.owners import Owners
from support.store import open_parts


async def test_answer_holds_each_file_or_its_errno(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        owners = Owners(index, store, ns)
        files = FileHandles(index, store, ns, spill, owners.grants_follow_setattr)
        ns.is_open = files.is_open
        data = {b"a": os.urandom(5000), b"b": b"", b"c": os.urandom(70_000)}
        for name, body in data.items():
            fh, _, _ = await files.create(ROOT_INO, name, 0o644, 0, 0)
            await files.write(fh, 0, body)
            await files.release(fh)
        gets = BatchGets(store, Leases(index, store, ns, owners).prefix_objects)
        paths = [b"a", b"missing", b"b", b"c"]
        answer = await gets.answer([(b"", paths)])
        raw = bytes(answer[0:len(answer)])
        index_ = protocol.decode_get_index(raw, len(paths))
        assert [e[0] for e in index_] == [0, errno.ENOENT, 0, 0]
        pos = protocol.get_data_offset(len(paths))
        for path, (err, size, digest) in zip(paths, index_):
            if err:
                continue
            assert raw[pos:pos + size] == data[path] and digest == xxhash.xxh3_64_intdigest(data[path])
            pos += size
        assert pos == len(answer)
        assert all(o.refs == 0 for o in store.objs.values())
        capped = await gets.answer([(b"", [b"a", b"c"])], cap=6000)
        assert [e[0] for e in protocol.decode_get_index(bytes(capped[0:len(capped)]), 2)] == [0, errno.EFBIG]
