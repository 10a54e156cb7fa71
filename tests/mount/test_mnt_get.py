"""``.kvfs/get`` through a real mount: many small files' bytes in one answer, per-entry
errnos, the caller's permissions (a real second user), a file replaced between request and
read, the client's split of large batches, and a killed daemon (misses, not exceptions)."""
from __future__ import annotations

import errno
import os
import struct

import pytest
import xxhash

from support.files import MiB, content, put
from support.users import reachable
from kvfs import protocol
from kvfs.integrations.pages import PageStore
from kvfs.kv import getbatch
from kvfs.kv.getbatch import GetClient

pytestmark = pytest.mark.mount

KiB = 1 << 10


def dests_for(sizes: list[int]) -> list[list[memoryview]]:
    return [[memoryview(bytearray(n))] for n in sizes]


def test_get_answers_a_mixed_batch_per_entry(kvfs_mount):
    m = kvfs_mount()
    d = m.path / "d"
    pages = {"a": content("a", 256 * KiB), "sub/b": content("b", 100 * KiB), "big": content("big", 2 * MiB),
             "empty": b""}
    for name, data in pages.items():
        put(d / name, data)
    (d / "adir").mkdir()
    names = ["a", "missing", "sub/b", "adir", "big", "empty", "a", "nodir/x"]
    sizes = [len(pages.get(n, b"x" * 10)) for n in names]
    sizes[names.index("sub/b")] = 100 * KiB
    c = GetClient(str(m.path), str(d))
    try:
        dests = dests_for(sizes)
        res = c.get_into(names, dests)
        assert res == [0, errno.ENOENT, 0, errno.ENOENT, 0, 0, 0, errno.ENOENT]
        for name, dest, r in zip(names, dests, res):
            if r == 0:
                assert bytes(dest[0]) == pages[name], name
        # a caller expecting another size gets EIO for that entry only (its bytes are skipped)
        dests = dests_for([256 * KiB, 4096, 100 * KiB])
        assert c.get_into(["a", "sub/b", "sub/b"], dests) == [0, errno.EIO, 0]
        assert bytes(dests[0][0]) == pages["a"] and bytes(dests[2][0]) == pages["sub/b"]
        # scattered destinations: the bytes land in file order
        segs = [memoryview(bytearray(1000)), memoryview(bytearray(256 * KiB - 1000))]
        assert c.get_into(["a"], [segs]) == [0]
        assert bytes(segs[0]) + bytes(segs[1]) == pages["a"]
    finally:
        c.close()


def test_get_counts_hits_and_misses_per_namespace(kvfs_mount):
    """Each entry of a get is a hit or (ENOENT) a miss of its namespace in ``.kvfs/stats``,
    paths relative to a base included, as lookup and lease count them."""
    m = kvfs_mount()
    put(m.path / "na" / "a", b"a" * 4096)
    put(m.path / "nb" / "b", b"b" * 4096)

    def counts() -> dict:
        ns = m.stats()["namespaces"]
        return {k: (ns.get(k, {}).get("hits", 0), ns.get(k, {}).get("misses", 0)) for k in ("na", "nb", "nc")}
    before = counts()
    c = GetClient(str(m.path), str(m.path))
    try:
        names = ["na/a", "na/x", "nb/b", "nb/y", "nb/z", "nc/q"]
        assert c.get_into(names, dests_for([4096] * 6)) == [0, errno.ENOENT, 0, errno.ENOENT, errno.ENOENT,
                                                            errno.ENOENT]
    finally:
        c.close()
    c = GetClient(str(m.path), str(m.path / "nb"))
    try:
        assert c.get_into(["b", "w"], dests_for([4096] * 2)) == [0, errno.ENOENT]
    finally:
        c.close()
    after = counts()
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    assert delta == {"na": (1, 1), "nb": (2, 3), "nc": (0, 1)}


def raw_index(fd: int, n: int) -> list[tuple[int, int, int]]:
    return protocol.decode_get_index(os.pread(fd, protocol.get_data_offset(n), 0), n)


def test_a_file_replaced_between_request_and_read_is_old_or_new_never_a_mix(kvfs_mount):
    m = kvfs_mount()
    old, new = content("old", 512 * KiB), content("new", 512 * KiB)
    put(m.path / "p", old)
    fd = os.open(m.path / ".kvfs" / protocol.GET_FILE, os.O_RDWR)
    try:
        at = protocol.get_data_offset(1)
        # replaced after the request, before the first read: the new version, whole
        os.pwrite(fd, protocol.request("", ["p"]), 0)
        put(m.path / "p", new)
        [(err, size, digest)] = raw_index(fd, 1)
        assert (err, size) == (0, len(new)) and digest == xxhash.xxh3_64_intdigest(new)
        assert os.pread(fd, len(new), at) == new
        # replaced (and the old object freed) while the answer is being read: the old one, whole
        os.pwrite(fd, protocol.request("", ["p"]), 0)
        first = os.pread(fd, at + 4096, 0)
        put(m.path / "p", old)
        os.unlink(m.path / "p")
        rest = os.pread(fd, len(new), at + 4096)
        assert first[at:] + rest == new
        assert protocol.decode_get_index(first, 1)[0][2] == xxhash.xxh3_64_intdigest(new)
    finally:
        os.close(fd)


INTRUDER_GET = """
import os, struct, sys
mnt, names = sys.argv[1], sys.argv[2:]
fd = os.open(os.path.join(mnt, ".kvfs", "get"), os.O_RDWR)
os.pwrite(fd, ("\\n".join(names) + "\\n").encode(), 0)
n = len(names)
at = (8 + 24 * n + 4095) // 4096 * 4096
head = os.pread(fd, at, 0)
errs = [struct.unpack_from("<iIQQ", head, 8 + 24 * i)[0] for i in range(n)]
data = os.pread(fd, 1 << 20, at)
print(" ".join(map(str, errs)), len(data), data[:8].hex())
"""


def test_another_user_gets_only_what_it_could_open(kvfs_mount, intruder):
    m = kvfs_mount(allow_other=True)
    put(m.path / "open" / "f", b"o" * 5000)
    put(m.path / "open" / "secret", b"s" * 5000)
    os.chmod(m.path / "open" / "secret", 0o600)
    put(m.path / "closed" / "f", b"c" * 5000)
    os.chmod(m.path / "closed", 0o700)
    with reachable(m.path):
        res = intruder.run(INTRUDER_GET, m.path, "open/f", "open/secret", "closed/f", "open/f")
    out = res.stdout.split()
    assert out[:4] == ["0", str(errno.ENOENT), str(errno.ENOENT), "0"]
    assert int(out[4]) == 10000 and out[5] == (b"o" * 8).hex()


def test_the_client_splits_a_batch_over_the_cap(kvfs_mount, monkeypatch):
    m = kvfs_mount()
    pages = [content(str(i), 300 * KiB) for i in range(8)]
    for i, p in enumerate(pages):
        put(m.path / f"p{i}", p)
    monkeypatch.setattr(protocol, "GET_MAX", 1 * MiB)      # this client's cap: 3 pages a request
    calls = []
    real = getbatch.GetClient._request

    def counting(self, rels, dests, sizes):
        calls.append(len(rels))
        return real(self, rels, dests, sizes)
    monkeypatch.setattr(getbatch.GetClient, "_request", counting)
    c = GetClient(str(m.path), str(m.path))
    try:
        dests = dests_for([300 * KiB] * 8)
        assert c.get_into([f"p{i}" for i in range(8)], dests) == [0] * 8
        assert [bytes(x[0]) for x in dests] == pages and calls == [3, 3, 2]
    finally:
        c.close()


def test_page_store_reads_small_pages_by_one_get_and_a_killed_daemon_gives_misses(kvfs_mount):
    """Pages under the RAM tier's ``ram_mapped_min`` (256 KiB) live in the daemon: one .kvfs/get."""
    m = kvfs_mount()
    store = PageStore(m.path, "pages")
    pages = [content(f"s{i}", 128 * KiB) for i in range(40)]
    names = [f"k{i}" for i in range(40)]
    assert store.write_many(names, lambda i: [pages[i]]) == [True] * 40
    dests = dests_for([128 * KiB] * 41)
    assert store.read_into(names + ["absent"], dests) == [True] * 40 + [False]
    assert [bytes(x[0]) for x in dests[:40]] == pages
    st = store.statistics()
    assert st.batch_reads == 40 and st.lease_fallbacks == 0 and st.hits == 40
    # lookup-and-pin (LMCache): the held pages have no fast path either
    k, held = store.hold(names[:10])
    assert k == 10
    dests = dests_for([128 * KiB] * 10)
    assert store.read_held(held, names[:10], dests) == [True] * 10
    store.release_hold(held)
    assert [bytes(x[0]) for x in dests] == pages[:10]
    assert store.statistics().batch_reads == 50 and store.statistics().lease_fallbacks == 0
    c = GetClient(str(m.path), str(m.path / "pages"))
    m.kill9()
    with pytest.raises(OSError) as e:
        c.get_into(names[:2], dests_for([128 * KiB] * 2))
    assert e.value.errno == errno.ENOTCONN
    c.close()
    assert store.read_into(names[:5], dests_for([128 * KiB] * 5)) == [False] * 5
    assert store.statistics().errors >= 1
    store.close()


def test_get_refuses_lease_options(kvfs_mount):
    m = kvfs_mount()
    put(m.path / "f", b"x")
    fd = os.open(m.path / ".kvfs" / protocol.GET_FILE, os.O_RDWR)
    try:
        os.pwrite(fd, b"\0ttl 5\nf\n", 0)
        with pytest.raises(OSError) as e:
            os.pread(fd, 4096, 0)
        assert e.value.errno == errno.EINVAL
        os.pwrite(fd, b"f\n", 0)
        head = os.pread(fd, 8192, 0)
        assert struct.unpack_from("<iIQQ", head, 8)[:3] == (0, 0, 1) and head[4096:] == b"x"
    finally:
        os.close(fd)


def test_the_daemon_answers_efbig_past_the_answers_cap(kvfs_mount):
    """A raw request (the client would split it) whose files hold more than ``GET_MAX``
    (64 MiB) of data: the daemon answers the files that fit, in request order, and EFBIG for
    the one that would pass the cap (a smaller one after it still fits)."""
    m = kvfs_mount(ram="256MiB")
    sizes = {"f0": 33 * MiB, "f1": 32 * MiB, "small": 4 * KiB}
    assert sizes["f0"] + sizes["f1"] > protocol.GET_MAX > sizes["f0"] + sizes["small"]
    for k, (name, size) in enumerate(sizes.items()):
        put(m.path / name, bytes([k + 1]) * size)
    fd = os.open(m.path / ".kvfs" / protocol.GET_FILE, os.O_RDWR)
    try:
        os.pwrite(fd, "".join(f"{n}\n" for n in sizes).encode(), 0)
        index = raw_index(fd, len(sizes))
        assert [(e, s) for e, s, _ in index] == [(0, 33 * MiB), (errno.EFBIG, 0), (0, 4 * KiB)]
        off, want = protocol.get_data_offset(len(sizes)), 33 * MiB + 4 * KiB
        data = bytearray()
        while len(data) < want:
            chunk = os.pread(fd, want - len(data), off + len(data))
            assert chunk, f"the answer ended at {len(data)} of {want} data bytes"
            data += chunk
        assert os.pread(fd, 4096, off + want) == b""          # nothing of f1's
        assert data == b"\x01" * (33 * MiB) + b"\x03" * (4 * KiB)
        assert index[0][2] == xxhash.xxh3_64_intdigest(b"\x01" * (33 * MiB))
    finally:
        os.close(fd)
