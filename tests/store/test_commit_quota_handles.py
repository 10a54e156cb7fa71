"""Committing entries under a quota leaves no per-handle quota state behind: the handle of
each committed (published) entry is forgotten, as that of a failed one is."""
from __future__ import annotations

import os

from kvfs.quota import Quotas
from kvfs.store.caller import CallerFile
from kvfs.store.commit import CommitEntry
from kvfs.store.cred import Cred
from kvfs.store.index import ROOT_INO
from support.store import open_store

ROOT = Cred(0, 0)


async def test_committed_entries_leave_no_quota_handles(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(os.urandom(3 * 8192))
    fd = os.open(src, os.O_RDONLY)
    async with open_store(tmp_path, ram=4 << 20, nvme=16 << 20) as kvstore:
        quotas = Quotas(kvstore)
        first = await kvstore.commits.commit_entries([CommitEntry(b"t/seed", CallerFile(fd), 0, 100)], ROOT,
                                           quotas, dirmode=0o755)
        assert not isinstance(first[0], BaseException), first
        quotas.set_xattr(kvstore.index.lookup(ROOT_INO, b"t"), b"8MiB", 0)
        entries = [CommitEntry(b"t/%d" % i, CallerFile(fd), i * 8192, 8192) for i in range(3)]
        done = await kvstore.commits.commit_entries(entries, ROOT, quotas)
        assert not any(isinstance(r, BaseException) for r in done), done
        assert all(kvstore.index.lookup(kvstore.index.lookup(ROOT_INO, b"t"), b"%d" % i) for i in range(3))
        assert quotas._fh_ns == {} and quotas._owed == {} and quotas._refused_fh == {}
    os.close(fd)
