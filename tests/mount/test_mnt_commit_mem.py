"""``.kvfs/commit`` entries named by address in the caller's own memory (``\\0mem``): one copy
instead of two, through a real mount; the checks that keep it to the caller's own pages (a
real second user, a process that is not dumpable, a range it does not map); the client's
fallback to its memfd."""
from __future__ import annotations

import errno
import json
import os

import pytest
import xxhash

from support.files import MiB, content, read
from support.users import reachable
from kvfs.kv import commit as commit_mod
from kvfs.kv.commit import CommitClient

pytestmark = pytest.mark.mount


def test_writable_buffers_are_named_by_address_and_stored_exactly(kvfs_mount):
    m = kvfs_mount()
    (m.path / "d").mkdir()
    pages = {f"p{i}": bytearray(content(f"p{i}", n)) for i, n in enumerate((2 * MiB, 512 << 10, 4096, 1))}
    ro = content("ro", 300 << 10)                   # read-only: through the memfd
    split = content("split", 64 << 10)              # read-only in two buffers: through the memfd
    k, v = bytearray(content("k", 256 << 10)), bytearray(content("v", 256 << 10))
    whole = bytearray(content("whole", 100 << 10))  # two neighbouring views: one range
    c = CommitClient(str(m.path))
    try:
        items = [(n, [b]) for n, b in pages.items()] + [("ro", [ro]), ("split", [split[:100], split[100:]]),
                                                       ("kv", [k, memoryview(v)[:1000], memoryview(v)[1000:]]),
                                                       ("whole", [memoryview(whole)[:7], memoryview(whole)[7:]])]
        views = commit_mod._views
        assert c._ranges(views([memoryview(whole)[:7], memoryview(whole)[7:]])) == c._ranges(views([whole]))
        assert c._ranges(views([k, v])).count("+") == 2
        assert c.commit("d", items) == [0] * 8
        assert c.use_memory
        assert c._lanes[0].size == len(ro) + len(split)     # only those two were copied by the client
        only_memory = [(f"again{i}", [b]) for i, b in enumerate(pages.values())]
        assert c.commit("d", only_memory) == [0] * 4
        assert c._lanes[0].size == len(ro) + len(split)
    finally:
        c.close()
    for name, data in [*pages.items(), ("ro", ro), ("split", split), ("kv", k + v), ("whole", whole)] + [(f"again{i}", b) for i, b in enumerate(pages.values())]:
        assert read(m.path / "d" / name) == data, name
        assert os.getxattr(m.path / "d" / name, "user.kvfs.checksum").decode() == xxhash.xxh3_64_hexdigest(data)
    assert sorted(n for n in os.listdir(m.path / "d") if n.startswith(".")) == []


def test_a_buffer_changed_after_its_commit_does_not_change_the_stored_file(kvfs_mount):
    m = kvfs_mount()
    buf = bytearray(content("x", 1 * MiB))
    want = bytes(buf)
    c = CommitClient(str(m.path))
    try:
        assert c.commit("", [("f", [buf])]) == [0]
        buf[:] = b"\xff" * len(buf)
    finally:
        c.close()
    assert read(m.path / "f") == want


def test_a_daemon_that_does_not_read_memory_gets_the_bytes_through_the_memfd(kvfs_mount, monkeypatch):
    """An older daemon answers the unknown directive with EINVAL for the whole request."""
    m = kvfs_mount()
    real = commit_mod.protocol.commit_request
    monkeypatch.setattr(commit_mod.protocol, "commit_request",
                        lambda *a, **k: real(*a, **k).replace(b"\0mem\n", b"\0memory\n"))
    data = bytearray(content("old", 256 << 10))
    c = CommitClient(str(m.path))
    try:
        assert c.commit("", [("f", [data]), ("g", [bytes(data)])]) == [0, 0]
        assert not c.use_memory and c._lanes[0].size == 2 * len(data)
    finally:
        c.close()
    assert read(m.path / "f") == data and read(m.path / "g") == data


# the intruder (a real second user) names ranges of its own memory: a bytearray's, one past
# the end of its address space, and, after prctl(PR_SET_DUMPABLE, 0), its bytearray's again
INTRUDER_MEM = r"""
import ctypes, json, os, sys
mnt, target = sys.argv[1], sys.argv[2]
data = bytearray(b"m" * 8192)
at = ctypes.addressof(ctypes.c_char.from_buffer(data))
if sys.argv[3] == "undumpable":
    assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0      # PR_SET_DUMPABLE
ctl = os.open(mnt + "/.kvfs/commit", os.O_RDWR)
req = ("\0mem\n%d 8192 %s\n%d 8192 %s.bad\n" % (at, target, (1 << 47) - 8192, target)).encode()
os.pwrite(ctl, req, 0)
print(json.dumps(json.loads(os.pread(ctl, 1 << 20, 0))["results"]))
"""


def test_another_user_commits_its_own_memory_only_while_dumpable(kvfs_mount, intruder):
    m = kvfs_mount(allow_other=True)
    mine = m.path / "mine"
    mine.mkdir()
    os.chown(mine, intruder.uid, intruder.gid)
    with reachable(m.path):
        res = intruder.run(INTRUDER_MEM, m.path, "mine/f", "dumpable")
        assert json.loads(res.stdout) == [0, errno.EFAULT]
        res = intruder.run(INTRUDER_MEM, m.path, "mine/g", "undumpable")
        assert json.loads(res.stdout) == [errno.EPERM, errno.EPERM]
    st = os.stat(mine / "f")
    assert (st.st_uid, st.st_gid) == (intruder.uid, intruder.gid) and read(mine / "f") == b"m" * 8192
    assert sorted(os.listdir(mine)) == ["f"]
