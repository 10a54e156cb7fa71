"""``.kvfs/commit`` through a real mount: batched publication of bytes the caller holds in a
memfd, the daemon's own copy, the descriptor and permission checks (a real second user),
quotas, and a daemon killed in the middle of a batch."""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import xxhash

from support.files import MiB, content, put, read
from support.mount import run_kvfs, wait_for
from support.users import reachable
from kvfs.integrations.pages import PageStore
from kvfs.kv.commit import CommitClient
from kvfs.protocol import commit_request

pytestmark = pytest.mark.mount


def raw_commit(mnt, request: bytes) -> list[int]:
    """One request on .kvfs/commit as this process: the per-entry errnos."""
    fd = os.open(mnt / ".kvfs" / "commit", os.O_RDWR)
    try:
        os.pwrite(fd, request, 0)
        return json.loads(os.pread(fd, 1 << 20, 0))["results"]
    finally:
        os.close(fd)


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("test-commit")
    os.write(fd, data)
    return fd


def leftovers(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(".kvfs-commit"))


def test_commit_publishes_a_batch_as_close_and_rename_would(kvfs_mount):
    m = kvfs_mount()
    d = m.path / "d"
    (d / "sub").mkdir(parents=True)
    with pytest.raises(FileNotFoundError):      # the kernel now holds a negative entry for it
        os.stat(d / "a")
    pages = {"a": content("a", 2 * MiB), "sub/b": content("b", 256 << 10), "empty": b""}
    c = CommitClient(str(m.path))
    try:
        items = [("a", [pages["a"][:1000], pages["a"][1000:]]), ("sub/b", [pages["sub/b"]]),
                 ("empty", []), ("nodir/c", [b"x"]), ("../escape", [b"x"]), ("sub", [b"x"])]
        assert c.commit("d", items) == [0, 0, 0, errno.ENOENT, errno.EINVAL, errno.EISDIR]
        for name, data in pages.items():
            assert read(d / name) == data, name
            assert os.getxattr(d / name, "user.kvfs.checksum").decode() == xxhash.xxh3_64_hexdigest(data)
        st = os.stat(d / "a")
        assert st.st_size == 2 * MiB and st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o644
        assert not (m.path / "escape").exists() and not (d / "nodir").exists()
        # replace (as rename does), or keep with noreplace (EEXIST)
        assert c.commit("d", [("a", [b"new"])]) == [0]
        assert read(d / "a") == b"new"
        assert c.commit("d", [("a", [b"newer"]), ("c2", [b"c2"])], noreplace=True) == [errno.EEXIST, 0]
        assert read(d / "a") == b"new" and read(d / "c2") == b"c2"
        assert c.commit("", [(".kvfs", [b"x"])]) == [errno.EPERM]
    finally:
        c.close()
    assert leftovers(d) == [] and leftovers(d / "sub") == []


def test_commit_of_many_groups_publishes_every_entry(kvfs_mount):
    """A request of several copy groups (32 entries or 64 MiB each; the next group's copies run
    while the one before it is sealed): every entry published with its own bytes, a failed
    entry fails alone, a name given twice with noreplace keeps its first entry's bytes."""
    m = kvfs_mount(ram="256MiB")
    d = m.path / "g"
    d.mkdir()
    pages = {f"p{i:03d}": content(f"p{i}", (3 * MiB if i % 7 == 0 else 64 << 10) + i) for i in range(100)}
    items = [(n, [b]) for n, b in pages.items()]
    items.insert(40, ("nodir/x", [b"x"]))       # in the second group
    items.append(("p010", [b"second"]))          # in the last group: an earlier group's name
    c = CommitClient(str(m.path))
    try:
        res = c.commit("g", items, noreplace=True)
    finally:
        c.close()
    assert res[40] == errno.ENOENT and res[-1] == errno.EEXIST, res
    assert all(r == 0 for i, r in enumerate(res) if i not in (40, len(res) - 1)), res
    for n, b in pages.items():
        assert read(d / n) == b, n
        assert os.getxattr(d / n, "user.kvfs.checksum").decode() == xxhash.xxh3_64_hexdigest(b)
    assert leftovers(d) == []


def test_bytes_changed_after_commit_do_not_change_the_stored_file(kvfs_mount):
    m = kvfs_mount()
    data = content("orig", 1 * MiB)
    fd = memfd_with(data)
    try:
        assert raw_commit(m.path, commit_request("", fd, [(0, len(data), "f")])) == [0]
        os.pwrite(fd, b"\xff" * len(data), 0)     # the client reuses its buffer at once
        assert read(m.path / "f") == data
        assert os.getxattr(m.path / "f", "user.kvfs.checksum").decode() == xxhash.xxh3_64_hexdigest(data)
        m.remount()                               # the checksum agrees with the bytes kept
        assert read(m.path / "f") == data
    finally:
        os.close(fd)


def test_a_source_changed_during_the_copy_stores_bytes_and_checksums_that_agree(kvfs_mount):
    """The copy checksums the daemon's own copy of each piece (not the caller's memory, which
    a thread of the caller scribbles on meanwhile): the whole-object and the per-chunk sums
    agree with the stored bytes, also once they come back from NVMe (read back verified)."""
    m = kvfs_mount()
    size = 3 * MiB + 123                          # four chunks, the last one short
    fd = memfd_with(content("orig", size))
    stop = threading.Event()

    def scribble() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            os.pwrite(fd, bytes([k & 0xFF]) * 4096, (k * 65537) % (size - 4096))
    t = threading.Thread(target=scribble)
    t.start()
    try:
        names = [f"f{i}" for i in range(8)]
        assert raw_commit(m.path, commit_request("", fd, [(0, size, n) for n in names])) == [0] * 8
    finally:
        stop.set()
        t.join()
        os.close(fd)
    stored = {}
    for n in names:
        stored[n] = read(m.path / n)
        assert len(stored[n]) == size
        assert os.getxattr(m.path / n, "user.kvfs.checksum").decode() == xxhash.xxh3_64_hexdigest(stored[n])
    m.remount()                                   # RAM is volatile: the reads below come from NVMe
    for n in names:
        assert read(m.path / n) == stored[n], n


def test_a_large_batch_goes_as_pipelined_requests_with_results_in_order(kvfs_mount, monkeypatch):
    """A batch over twice PIPELINE_BYTES is sent in parts on two control descriptors (the next
    part copied into the other memfd while the daemon serves one): one result per item in
    order, a failed entry and a noreplace name given twice in different parts as in one request."""
    import kvfs.kv.commit as commit_mod
    monkeypatch.setattr(commit_mod, "PIPELINE_BYTES", 1 * MiB)
    m = kvfs_mount()
    (m.path / "p").mkdir()
    pages = {f"q{i:02d}": content(f"q{i}", (256 << 10) + i) for i in range(40)}
    items = [(n, [b]) for n, b in pages.items()]
    items.insert(17, ("nodir/x", [b"x"]))
    items.append(("q03", [b"again"]))            # its first entry is several parts earlier
    c = CommitClient(str(m.path))
    try:
        res = c.commit("p", items, noreplace=True)
        assert len(c._lanes) == 2               # it did go in parts, on two lanes
        again = c.commit("p", [(n, [b"other"]) for n in list(pages)[:10]], noreplace=True)
    finally:
        c.close()
    assert res[17] == errno.ENOENT and res[-1] == errno.EEXIST, res
    assert all(r == 0 for i, r in enumerate(res) if i not in (17, len(res) - 1)), res
    assert again == [errno.EEXIST] * 10
    for n, b in pages.items():
        assert read(m.path / "p" / n) == b, n
    assert leftovers(m.path / "p") == []


@pytest.fixture
def shm_dir(tmp_path):
    """A directory on a tmpfs (/dev/shm), removed after the test."""
    d = Path(tempfile.mkdtemp(prefix="kvfs-test-commit-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_commit_refuses_descriptors_the_caller_may_not_read(kvfs_mount, shm_dir):
    m = kvfs_mount()
    secret = shm_dir / "secret"
    secret.write_bytes(b"s" * 4096)
    wronly = os.open(secret, os.O_WRONLY)
    opath = os.open(secret, os.O_PATH)
    dirfd = os.open(shm_dir, os.O_RDONLY)
    put(m.path / "onmount", b"m" * 4096)
    onmount = os.open(m.path / "onmount", os.O_RDONLY)
    short = memfd_with(b"x" * 100)
    try:
        unused = max(wronly, opath, dirfd, onmount, short) + 100
        cases = {"notheld": (unused, errno.EBADF), "wronly": (wronly, errno.EBADF),
                 "opath": (opath, errno.EBADF), "dir": (dirfd, errno.EBADF),
                 "onmount": (onmount, errno.EXDEV)}
        for name, (fd, want) in cases.items():
            assert raw_commit(m.path, commit_request("", fd, [(0, 4096, name)])) == [want], name
        assert raw_commit(m.path, commit_request("", short, [(0, 4096, "short")])) == [errno.EINVAL]
        for bad in (b"1 2 x\n", b"\0fd 3\n-1 2 x\n", b"\0fd 3\n\0bogus\n", b"\0fd 3\n1 x\n"):
            with pytest.raises(OSError) as e:
                raw_commit(m.path, bad)
            assert e.value.errno == errno.EINVAL, bad
    finally:
        for fd in (wronly, opath, dirfd, onmount, short):
            os.close(fd)
    assert sorted(os.listdir(m.path)) == ["onmount"]


INTRUDER_COMMIT = r"""
import json, os, sys
mnt, target = sys.argv[1], sys.argv[2]
data = b"i" * 8192
fd = os.memfd_create("x"); os.write(fd, data)
secret = os.open(sys.argv[3], os.O_RDONLY) if len(sys.argv) > 3 else fd
ctl = os.open(mnt + "/.kvfs/commit", os.O_RDWR)
req = ("\0fd %d\n0 8192 %s\n\0fd %d\n0 8192 %s.2\n" % (fd, target, secret, target)).encode()
os.pwrite(ctl, req, 0)
print(json.dumps(json.loads(os.pread(ctl, 1 << 20, 0))["results"]))
"""


def test_commit_reads_only_memfds_and_tmpfs_files(kvfs_mount, shm_dir):
    """A readable file on any other filesystem -- the disk, another FUSE mount (which could
    stall the daemon's worker on its own requests) -- is refused with EINVAL before anything
    asks that filesystem; a memfd and a tmpfs file are read."""
    m, other = kvfs_mount(), kvfs_mount()
    data = content("src", 8192)
    (shm_dir / "src").write_bytes(data)
    put(other.path / "src", data)
    fds = {"memfd": memfd_with(data), "tmpfs": os.open(shm_dir / "src", os.O_RDONLY),
           "disk": os.open(__file__, os.O_RDONLY), "fuse": os.open(other.path / "src", os.O_RDONLY)}
    try:
        got = {name: raw_commit(m.path, commit_request("", fd, [(0, 4096, name)]))[0]
               for name, fd in fds.items()}
    finally:
        for fd in fds.values():
            os.close(fd)
    assert got == {"memfd": 0, "tmpfs": 0, "disk": errno.EINVAL, "fuse": errno.EINVAL}
    assert read(m.path / "memfd") == data[:4096] and read(m.path / "tmpfs") == data[:4096]
    assert sorted(os.listdir(m.path)) == ["memfd", "tmpfs"]


def test_another_user_commits_only_where_it_may_create(kvfs_mount, intruder):
    m = kvfs_mount(allow_other=True)
    (m.path / "roots").mkdir(mode=0o755)
    mine = m.path / "mine"
    mine.mkdir()
    os.chown(mine, intruder.uid, intruder.gid)
    sticky = m.path / "sticky"
    sticky.mkdir(mode=0o777)
    os.chmod(sticky, 0o1777)
    put(sticky / "roots-file", b"root")
    with reachable(m.path):
        res = intruder.run(INTRUDER_COMMIT, m.path, "roots/f")
        assert json.loads(res.stdout) == [errno.EACCES, errno.EACCES]
        res = intruder.run(INTRUDER_COMMIT, m.path, "sticky/roots-file")
        assert json.loads(res.stdout) == [errno.EPERM, 0]
        res = intruder.run(INTRUDER_COMMIT, m.path, "mine/f")
        assert json.loads(res.stdout) == [0, 0]
        mkdirs = INTRUDER_COMMIT.replace('req = ("\\0fd', 'req = ("\\0mkdir 750\\n\\0fd')
        assert mkdirs != INTRUDER_COMMIT
        res = intruder.run(mkdirs, m.path, "roots/sub/f")      # mkdir needs write on roots
        assert json.loads(res.stdout) == [errno.EACCES, errno.EACCES]
        res = intruder.run(mkdirs, m.path, "mine/sub/f")
        assert json.loads(res.stdout) == [0, 0]
    st = os.stat(mine / "sub")
    assert (st.st_uid, st.st_mode & 0o7777) == (intruder.uid, 0o750)
    assert os.listdir(m.path / "roots") == []
    assert read(sticky / "roots-file") == b"root"
    st = os.stat(mine / "f")
    assert (st.st_uid, st.st_gid) == (intruder.uid, intruder.gid) and read(mine / "f") == b"i" * 8192


def test_another_user_cannot_commit_a_file_it_may_not_read(kvfs_mount, intruder, shm_dir):
    """The daemon (root) could read anything: the caller's own descriptor must be readable."""
    m = kvfs_mount(allow_other=True)
    mine = m.path / "mine"
    mine.mkdir()
    os.chown(mine, intruder.uid, intruder.gid)
    secret = shm_dir / "secret"
    secret.write_bytes(b"s" * 8192)
    os.chmod(secret, 0o600)
    code = INTRUDER_COMMIT.replace("os.open(sys.argv[3], os.O_RDONLY)", "os.open(sys.argv[3], os.O_WRONLY)")
    os.chmod(secret, 0o622)            # the intruder may write it, not read it
    with reachable(m.path), reachable(shm_dir):
        res = intruder.run(code, m.path, "mine/f", secret)
    assert json.loads(res.stdout) == [0, errno.EBADF]
    assert not (mine / "f.2").exists()


def test_commit_past_a_quota_is_refused(kvfs_mount):
    m = kvfs_mount()
    (m.path / "t").mkdir()
    assert run_kvfs("quota", "set", m.path, "t", "1MiB").returncode == 0
    c = CommitClient(str(m.path))
    try:
        got = c.commit("t", [("small", [b"x" * 4096]), ("big", [b"y" * (2 * MiB)])])
    finally:
        c.close()
    assert got == [0, errno.EDQUOT]
    assert "big" not in os.listdir(m.path / "t") and leftovers(m.path / "t") == []
    assert m.stats()["quotas"]["refused"] >= 1


def test_killed_daemon_mid_batch_gives_failed_sets_not_exceptions(kvfs_mount):
    m = kvfs_mount(ram="256MiB")
    store = PageStore(m.path, "pages")
    page = content("p", 1 * MiB)
    results: list[list[bool]] = []
    started = threading.Event()

    def writer() -> None:
        for k in range(40):
            started.set()
            results.append(store.write_many([f"b{k}-{i}" for i in range(64)], lambda i: [page]))
    t = threading.Thread(target=writer)
    t.start()
    started.wait(60)
    wait_for(lambda: results or store.statistics().written, 120, "a first batch")
    m.kill9()
    t.join(300)
    assert not t.is_alive()
    stats = store.statistics()
    assert not all(all(r) for r in results), "every batch succeeded although the daemon was killed"
    assert stats.set_failures > 0 and stats.errors > 0
    assert store.prefix(["b0-0"]) == 0 and store.read_into(["b0-0"], [[memoryview(bytearray(MiB))]]) == [False]
    store.close()


def test_commit_into_makes_missing_subdirectories_and_retries(kvfs_mount):
    m = kvfs_mount()
    (m.path / "v").mkdir()
    c = CommitClient(str(m.path))
    try:
        items = [("abc/de_g0/h1.bin", [b"1" * 4096]), ("abc/de_g0/h2.bin", [b"2"]), ("top.bin", [b"t"])]
        assert c.commit("v", items) == [errno.ENOENT, errno.ENOENT, 0]
        with pytest.raises(FileNotFoundError):      # a negative entry the daemon must drop
            os.stat(m.path / "v/abc")
        assert c.commit_into("v", items, noreplace=True) == [0, 0, errno.EEXIST]
        c._mkdir = False                # a daemon without \0mkdir: ENOENT, makedirs, again
        assert c.commit_into("v", [("x/y/h3.bin", [b"3"])]) == [0]
    finally:
        c.close()
    assert read(m.path / "v/abc/de_g0/h1.bin") == b"1" * 4096 and read(m.path / "v/abc/de_g0/h2.bin") == b"2"
    assert read(m.path / "v/x/y/h3.bin") == b"3"
    umask = os.umask(0o022)
    os.umask(umask)
    for d in ("v/abc", "v/abc/de_g0", "v/x/y"):
        st = os.stat(m.path / d)
        assert (st.st_mode & 0o7777, st.st_uid) == (0o777 & ~umask, os.getuid()), d


def test_page_store_connecting_as_the_mount_dies_writes_nothing_under_it(kvfs_mount, monkeypatch):
    """The daemon killed and its mount detached between the page store's find_control and
    the rest of its connect (the race a prefetch loop hit when the daemon was SIGKILLed):
    the connect fails, nothing is made under the bare mount point, and a store of pages
    fails instead of landing there (it once made ``<mnt>/pages`` on the disk below and
    reported the pages stored)."""
    import kvfs.integrations.pages as pages
    m = kvfs_mount()
    real, killed = pages.find_control, []

    def then_killed(path):
        ctl = real(path)
        if not killed:
            killed.append(path)
            m.kill9()                    # the daemon dies right after it was found
        return ctl
    monkeypatch.setattr(pages, "find_control", then_killed)
    s = PageStore(m.path / "pages")
    assert s.write_many(["a", "b"], lambda i: [b"x" * 4096]) == [False, False]
    assert killed and not os.path.ismount(m.path)
    assert os.listdir(m.path) == []
    assert s.write_many(["c"], lambda i: [b"y" * 4096]) == [False]
    assert not s.on_kvfs and os.listdir(m.path) == []
    assert s.statistics().written == 0 and s.statistics().set_failures == 3


def test_page_store_writing_a_new_subdirectory_as_the_mount_dies_writes_nothing_under_it(kvfs_mount, monkeypatch):
    """The daemon killed and its mount detached after a page write found the store connected
    but before it made the page's subdirectory (names like vLLM's ``abc/de_g0/h.bin``): the
    write fails and nothing is made under the bare mount point (the subdirectory, and then
    the page, were once made on the disk below and the page reported stored)."""
    m = kvfs_mount()
    s = PageStore(m.path / "pages", use_commit=False)
    assert s.write_many(["first"], lambda i: [b"0" * 4096]) == [True]
    real_write, real_connect, writing, killed = s._write, s._connect, [], []

    def write(name, bufs):
        writing.append(name)
        return real_write(name, bufs)

    def connect_then_killed():
        lk = real_connect()
        if writing and not killed:
            killed.append(writing[-1])
            m.kill9()                    # the daemon dies right after the write found it
        return lk
    monkeypatch.setattr(s, "_write", write)
    monkeypatch.setattr(s, "_connect", connect_then_killed)
    assert s.write_many(["abc/de_g0/h1.bin"], lambda i: [b"x" * 4096]) == [False]
    assert killed == ["abc/de_g0/h1.bin"] and not os.path.ismount(m.path)
    assert os.listdir(m.path) == []
    assert s.statistics().written == 1 and s.statistics().set_failures == 1


def test_commit_into_as_the_mount_dies_makes_no_directory_under_it(kvfs_mount):
    """The daemon killed and its mount detached between the commit that found the
    subdirectories missing and their making: the directories are made through the mount
    root's descriptor, so they fail (ENOTCONN) instead of landing under the bare mount point."""
    m = kvfs_mount()
    (m.path / "v").mkdir()
    c = CommitClient(str(m.path))
    c._mkdir = False                 # as with a daemon that does not make directories itself
    real = c.commit

    def then_killed(*args, **kw):
        out = real(*args, **kw)
        m.kill9()
        return out
    c.commit = then_killed
    try:
        with pytest.raises(OSError) as e:
            c.commit_into("v", [("abc/de/h1.bin", [b"1" * 4096])], noreplace=True)
        assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    finally:
        c.close()
    assert not os.path.ismount(m.path) and os.listdir(m.path) == []


def test_kill9_after_commit_leaves_each_name_its_last_sealed_version_or_absent(kvfs_mount):
    """A committed entry is installed under its final name in one index transaction: after
    kill -9 a replaced name holds its old or its new bytes, a new name its bytes or nothing,
    and no temp file is left. (RAM smaller than the files: sealed versions live on NVMe.)"""
    m = kvfs_mount(ram="4MiB", nvme_size="64MiB")
    v1, v2, g = content("v1", 6 * MiB), content("v2", 6 * MiB), content("g", 5 * MiB)
    c = CommitClient(str(m.path))
    try:
        assert c.commit("", [("f", [v1])]) == [0]
        wait_for(lambda: os.getxattr(m.path / "f", "user.kvfs.tier") == b"nvme", 60, "f on NVMe")
        m.stats()                        # commits the pending index changes: v1 is durable
        assert c.commit("", [("f", [v2]), ("d/g", [g])], noreplace=False, dirmode=0o755) == [0, 0]
        m.kill9()
    finally:
        c.close()
    m.mount()
    assert read(m.path / "f") in (v1, v2)
    assert sorted(os.listdir(m.path)) in (["f"], ["d", "f"])
    try:
        assert read(m.path / "d" / "g") == g
    except FileNotFoundError:
        pass                             # the commit's transaction was lost with the daemon
    assert leftovers(m.path) == []
