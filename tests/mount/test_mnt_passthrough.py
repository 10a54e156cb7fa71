"""FUSE passthrough on a real mount (kvfs's own transport, kvfs/fs/session.py): sealed blocks
read by the kernel from their tier files, every guarantee kept (docs/design.md, "How a read
travels"). The daemon's request counts (``.kvfs/stats`` transport.by_opcode) say what reached
it: a read of a passthrough descriptor never does."""
from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import signal
import subprocess
import sys

import pytest

from support.files import MiB, content, read
from support.mount import wait_for
from support.users import reachable

pytestmark = pytest.mark.mount


def transport(m) -> dict:
    return m.stats()["transport"]


def reads(m) -> int:
    """READs of files (not of the .kvfs/ control files) that reached the daemon."""
    return transport(m)["data_reads"]


def opens(m) -> int:
    return transport(m)["passthrough"]["opens"]


def settled(m) -> dict:
    return wait_for(lambda: (st := m.stats())["settled"] and st, 60, "settled")


def every_way(path, size: int) -> list[bytes]:
    """read, pread, readv, mmap MAP_SHARED and MAP_PRIVATE of one descriptor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out = [os.read(fd, size + 1), os.pread(fd, size, 0)]
        a, b = bytearray(size // 2), bytearray(size - size // 2)
        assert os.preadv(fd, [a, b], 0) == size
        out.append(bytes(a + b))
        for flags in (mmap.MAP_SHARED, mmap.MAP_PRIVATE):
            with mmap.mmap(fd, size, flags, mmap.PROT_READ) as mm:
                out.append(mm[:])
        return out
    finally:
        os.close(fd)


def test_sealed_blocks_are_read_by_the_kernel(kvfs_mount, kvfs_cli):
    m = kvfs_mount("--passthrough", ram="64MiB")
    t = transport(m)
    assert t["name"] == "kernel" and t["passthrough"]["state"] == "on"
    assert "passthrough: on" in kvfs_cli("stat", m.path).stdout
    blocks = {m.path / f"b{i}.kv": content(f"b{i}", 2 * MiB + i * 4097) for i in range(3)}
    for p, data in blocks.items():
        p.write_bytes(data)                    # read right after the write: the runtime pattern
        before_reads, before_opens = reads(m), opens(m)
        assert all(got == data for got in every_way(p, len(data)))
        assert reads(m) == before_reads, "a passthrough read reached the daemon"
        assert opens(m) == before_opens + 1
    # a small block lives in the daemon's memory (no tier file): its reads are the daemon's
    small = m.path / "small.kv"
    small.write_bytes(b"s" * 5000)
    before_reads = reads(m)
    assert read(small) == b"s" * 5000
    assert reads(m) > before_reads


def test_nvme_copies_are_verified_before_the_kernel_gets_them(kvfs_mount):
    m = kvfs_mount("--passthrough", ram="8MiB", nvme_size="256MiB")
    blocks = {m.path / f"n{i}.kv": content(f"n{i}", 2 * MiB) for i in range(8)}
    for p, data in blocks.items():
        p.write_bytes(data)
    settled(m)
    on_nvme = [p for p in blocks if os.getxattr(p, "user.kvfs.tier") == b"nvme"]
    assert len(on_nvme) >= 2, "RAM of 8 MiB keeps at most 3 of 8 blocks"
    good, bad = on_nvme[0], on_nvme[1]
    path = json.loads(os.getxattr(bad, "user.kvfs.backing"))["path"]
    m.umount()                  # a flipped byte in the NVMe file (no page of it cached anywhere)
    with open(path, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0xFF]))
    m.mount()
    before_reads, before_opens = reads(m), opens(m)
    assert read(good) == blocks[good]
    assert opens(m) == before_opens + 1 and reads(m) == before_reads
    # the kernel is never given the bad copy; the daemon's read finds it (EIO, never wrong bytes)
    declined = transport(m)["passthrough"]["declined"]
    with pytest.raises(OSError) as e:
        read(bad)
    assert e.value.errno == errno.EIO
    assert transport(m)["passthrough"]["declined"] == declined + 1


def test_a_held_block_keeps_its_bytes_and_its_space(kvfs_mount):
    """Eviction, demotion, replacement and unlink of a block a passthrough descriptor holds:
    the reader keeps reading its bytes, the RAM budget keeps counting them until it closes."""
    m = kvfs_mount("--passthrough", ram="16MiB", nvme_size="256MiB")
    held, data = m.path / "held.kv", content("held", 4 * MiB)
    held.write_bytes(data)
    before = opens(m)
    fd = os.open(held, os.O_RDONLY)
    mm = mmap.mmap(fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        assert opens(m) == before + 1
        os.replace(held, m.path / "moved.kv")                               # rename keeps the inode
        (m.path / "other.kv").write_bytes(content("other", MiB))
        os.replace(m.path / "other.kv", m.path / "moved.kv")               # replaced: the old version dies
        for i in range(12):                                                 # 24 MiB through 16 MiB of RAM
            (m.path / f"push{i}.kv").write_bytes(content(f"push{i}", 2 * MiB))
        st = settled(m)
        assert st["tiers"]["ram"]["used"] >= len(data), "the held block's RAM is still counted"
        assert os.pread(fd, len(data), 0) == data and mm[:] == data
    finally:
        mm.close()
        os.close(fd)
    wait_for(lambda: m.stats()["settled"] and transport(m)["passthrough"]["held"] == 0, 60, "released")
    assert read(m.path / "moved.kv") == content("other", MiB)


# A reader in another process: holds one read-only descriptor; each line on its stdin makes it
# print its descriptor's inode, fstat size and the sha256 of read-to-EOF and of an mmap of it.
READER = r"""
import hashlib, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
for line in sys.stdin:
    st = os.fstat(fd)
    os.lseek(fd, 0, os.SEEK_SET)
    got = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    with mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
        mapped = hashlib.sha256(mm[:]).hexdigest()
    print(st.st_ino, st.st_size, hashlib.sha256(got).hexdigest(), mapped, flush=True)
"""


class Reader:
    def __init__(self, path):
        self.proc = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def sees(self) -> tuple:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        ino, size, digest, mapped = self.proc.stdout.readline().split()
        return int(ino), int(size), digest, mapped

    def close(self) -> None:
        self.proc.communicate("", timeout=30)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def passthrough(m) -> dict:
    return transport(m)["passthrough"]


def o_trunc(p, old: bytes) -> bytes:          # `echo x > file`: O_WRONLY|O_CREAT|O_TRUNC, write
    new = content("rewritten", 2 * MiB + 5)
    with open(p, "wb") as f:
        f.write(new)
    return new


def truncate(p, old: bytes) -> bytes:         # truncate(2) by path
    os.truncate(p, MiB + 7)
    return old[:MiB + 7]


def rdwr(p, old: bytes) -> bytes:             # O_RDWR, write in place
    fd = os.open(p, os.O_RDWR)
    try:
        assert os.pwrite(fd, b"new", 0) == 3
    finally:
        os.close(fd)
    return b"new" + old[3:]


@pytest.mark.parametrize("change", [o_trunc, truncate, rdwr], ids=lambda f: f.__name__)
def test_a_rewrite_of_a_held_file_renews_its_name(kvfs_mount, change):
    """A rewrite of a file that a passthrough reader holds goes through: its name gets a new
    inode with the same version (the kernel takes no other open of the held one), the rewrite
    is answered ESTALE and retried by the kernel on the new inode; the reader keeps its
    inode and version to the end, as after a rename over the name, and its space is counted
    until it closes."""
    m = kvfs_mount("--passthrough", ram="64MiB")
    p, old = m.path / "f.kv", content("old", 3 * MiB)
    p.write_bytes(old)
    ino = os.stat(p).st_ino
    before = passthrough(m)
    reader = Reader(p)
    try:
        assert reader.sees() == (ino, len(old), sha(old), sha(old))
        pt = passthrough(m)
        assert pt["opens"] == before["opens"] + 1 and pt["held"] == 1, "the reader is not passthrough"
        new = change(p, old)                                   # no ETXTBSY, no ESTALE
        pt = passthrough(m)
        assert pt["renewed"] == before["renewed"] + 1 and pt["busy"] == before["busy"]
        assert reader.sees() == (ino, len(old), sha(old), sha(old))
        st = os.stat(p)
        assert st.st_ino != ino and st.st_size == len(new) and st.st_nlink == 1
        assert read(p) == new                                  # a fresh open: the new version
        held = settled(m)["tiers"]["ram"]["used"]
        assert held >= len(old) + len(new), "the reader's version is still counted"
    finally:
        reader.close()
    st = wait_for(lambda: (st := m.stats())["settled"] and st["transport"]["passthrough"]["held"] == 0
                  and st, 60, "the reader's release")
    assert held - st["tiers"]["ram"]["used"] >= len(old), "the orphan's space was not freed"
    assert read(p) == new
    m.remount()
    assert read(p) == new and os.stat(p).st_size == len(new)


def test_what_cannot_be_renewed_stays_busy(kvfs_mount):
    """kvfs gives a file one name (link(2): EPERM), so no held file has several; a held file
    with no name (unlinked, reached through /proc/self/fd) cannot be renewed: ETXTBSY."""
    m = kvfs_mount("--passthrough", ram="64MiB")
    p, data = m.path / "f.kv", content("f", 3 * MiB)
    p.write_bytes(data)
    with pytest.raises(OSError) as e:
        os.link(p, m.path / "g.kv")
    assert e.value.errno == errno.EPERM
    fd = os.open(p, os.O_RDONLY)
    try:
        before = passthrough(m)
        assert before["held"] == 1
        os.unlink(p)
        with pytest.raises(OSError) as e:
            os.truncate(f"/proc/self/fd/{fd}", 5)
        assert e.value.errno == errno.ETXTBSY
        after = passthrough(m)
        assert after["busy"] == before["busy"] + 1 and after["renewed"] == before["renewed"]
        assert os.pread(fd, len(data) + 1, 0) == data and os.fstat(fd).st_size == len(data)
    finally:
        os.close(fd)


def test_a_second_user_gets_what_permissions_allow(kvfs_mount, intruder):
    m = kvfs_mount("--passthrough", ram="64MiB", allow_other=True)
    public, private = m.path / "public.kv", m.path / "private.kv"
    public.write_bytes(content("pub", 2 * MiB))
    private.write_bytes(content("priv", 2 * MiB))
    os.chmod(public, 0o644)
    os.chmod(private, 0o600)
    probe = r"""
import errno, os, sys, json
out = {}
for name in sys.argv[1:]:
    try:
        fd = os.open(name, os.O_RDONLY)
    except OSError as e:
        out[name] = ["open", e.errno]; continue
    got = os.pread(fd, 1 << 22, 0)
    try:
        os.pwrite(fd, b"x", 0); w = "wrote"
    except OSError as e:
        w = e.errno
    try:
        os.close(os.open(name, os.O_WRONLY)); o = "opened"
    except OSError as e:
        o = e.errno
    out[name] = [len(got), w, o]
    os.close(fd)
print(json.dumps(out))
"""
    before = opens(m)
    with reachable(m.path):
        res = json.loads(intruder.run(probe, public, private).stdout)
    assert res[str(public)] == [2 * MiB, errno.EBADF, errno.EACCES]
    assert res[str(private)] == ["open", errno.EACCES]
    assert opens(m) == before + 1
    assert read(public) == content("pub", 2 * MiB)


def test_a_second_user_cannot_rewrite_through_a_renewal(kvfs_mount, intruder):
    """Renewal changes nothing of who may do what: the kernel checks the caller's permission
    before it sends the open or truncate (``default_permissions``), the new inode has the
    old one's owner and mode, and the holder keeps its bytes whoever rewrote the name."""
    m = kvfs_mount("--passthrough", ram="64MiB", allow_other=True)
    modes = {"public.kv": 0o644, "private.kv": 0o600, "shared.kv": 0o666}
    data = {n: content(n, 2 * MiB) for n in modes}
    fds = {}
    before = passthrough(m)
    try:
        for n, mode in modes.items():
            (m.path / n).write_bytes(data[n])
            os.chmod(m.path / n, mode)
            fds[n] = os.open(m.path / n, os.O_RDONLY)          # held by root's passthrough readers
        assert passthrough(m)["opens"] == before["opens"] + 3 and passthrough(m)["held"] == 3
        inos = {n: os.stat(m.path / n).st_ino for n in modes}
        probe = r"""
import json, os, sys
out = {}
for name in sys.argv[1:]:
    res = []
    try:
        fd = os.open(name, os.O_WRONLY | os.O_TRUNC); os.write(fd, b"intruder"); os.close(fd); res.append("wrote")
    except OSError as e:
        res.append(e.errno)
    try:
        os.truncate(name, 3); res.append("truncated")
    except OSError as e:
        res.append(e.errno)
    try:
        with open(name, "rb") as f: res.append(len(f.read()))
    except OSError as e:
        res.append(e.errno)
    out[os.path.basename(name)] = res
print(json.dumps(out))
"""
        with reachable(m.path):
            res = json.loads(intruder.run(probe, *(m.path / n for n in modes)).stdout)
        assert res == {"public.kv": [errno.EACCES, errno.EACCES, 2 * MiB],
                       "private.kv": [errno.EACCES, errno.EACCES, errno.EACCES],
                       "shared.kv": ["wrote", "truncated", 3]}
        assert passthrough(m)["renewed"] == before["renewed"] + 1       # the one it may rewrite
        for n in ("public.kv", "private.kv"):
            assert os.stat(m.path / n).st_ino == inos[n] and read(m.path / n) == data[n]
        st = os.stat(m.path / "shared.kv")
        assert st.st_ino != inos["shared.kv"] and (st.st_uid, st.st_mode & 0o7777) == (0, 0o666)
        assert read(m.path / "shared.kv") == b"int"
        for n, fd in fds.items():
            assert os.pread(fd, 3 * MiB, 0) == data[n] and os.fstat(fd).st_size == len(data[n])
    finally:
        for fd in fds.values():
            os.close(fd)


@pytest.mark.parametrize("flags,name,state", [
    (("--transport", "pyfuse3"), "pyfuse3", "off (the pyfuse3 transport cannot negotiate it)"),
    (("--no-passthrough",), "kernel", "off (turned off: passthrough = false)"),
])
def test_fallbacks_serve_every_read_themselves(kvfs_mount, kvfs_cli, flags, name, state):
    m = kvfs_mount(*flags, ram="64MiB")
    t = transport(m)
    assert t["name"] == name and t["passthrough"]["state"] == state
    out = kvfs_cli("stat", m.path).stdout          # what an operator reads
    assert f"transport: {name} (" in out and f"passthrough: {state}" in out
    p, data = m.path / "b.kv", content("b", 2 * MiB)
    p.write_bytes(data)
    assert all(got == data for got in every_way(p, len(data)))
    if name == "kernel":                 # the written pages were kept: no READ was needed
        assert transport(m)["passthrough"]["opens"] == 0
    assert isinstance(reads(m), int)     # both fallbacks count the READs that reached the daemon


def test_without_cap_sys_admin_the_kernel_transport_cannot_run():
    code = "from kvfs.fs.session import unavailable; print(unavailable())"
    res = subprocess.run(["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", sys.executable,
                          "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "CAP_SYS_ADMIN" in res.stdout
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "None"


def _blocked_in_open(pid: int) -> bool:
    """Whether a thread of process ``pid`` is inside openat(2) (syscall 257 on x86-64)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                if f.read().split(" ", 1)[0] == "257":
                    return True
        except OSError:
            pass
    return False


def _on_nvme_behind_a_stoppable_disk(kvfs_mount, tmp_path, old: bytes):
    """A mount whose file ``f.kv`` (``old``) is on the NVMe tier, that tier's disk a mount we
    can stop (SIGSTOP) so that an open's check of the NVMe copy waits as long as we like."""
    lower = kvfs_mount(ram="256MiB")                 # the NVMe tier's disk: a mount we can stop
    (lower.path / "disk").mkdir()
    cfg = tmp_path / "kvfs.toml"
    cfg.write_text("read_deadline = 0\n")            # the check waits for the disk, however long
    m = kvfs_mount("--passthrough", ram="16MiB", nvme=lower.path / "disk" / "nvme", config=cfg)
    p = m.path / "f.kv"
    p.write_bytes(old)
    pushes = [m.path / f"push{i}.kv" for i in range(3)]
    for q in pushes:                                 # 21 MiB through 16 MiB of RAM: f.kv goes down
        q.write_bytes(content(q.name, 5 * MiB))
    wait_for(lambda: settled(m) and os.getxattr(p, "user.kvfs.tier") == b"nvme", 120, "f.kv on NVMe")
    for q in pushes:
        q.unlink()
    settled(m)
    return m, lower, p


def _open_while_replaced(m, lower, p, new: bytes, then=None) -> int:
    """A read-only open of ``p`` that waits for its NVMe copy's check while an ``O_TRUNC``
    writer writes ``new`` (sealed in RAM) and ``then()`` runs; its descriptor."""
    from concurrent.futures import ThreadPoolExecutor
    os.kill(lower.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            opening = pool.submit(os.open, p, os.O_RDONLY)
            wait_for(lambda: _blocked_in_open(m.pid), 60, "the daemon to open the NVMe copy for its check")
            fd = os.open(p, os.O_WRONLY | os.O_TRUNC)        # a new, longer version, sealed in RAM
            os.write(fd, new)
            os.close(fd)
            wait_for(lambda: m.stats()["open_handles"] == 1, 60, "the writer's RELEASE")
            if then is not None:
                then()
            os.kill(lower.pid, signal.SIGCONT)
            return opening.result(timeout=120)
    finally:
        os.kill(lower.pid, signal.SIGCONT)


def test_a_version_replaced_while_its_copy_is_checked_is_not_given(kvfs_mount, tmp_path):
    """The race behind the SIGBUS hunt (issue of the opt-in): an open chose its version, then
    waited (here: the NVMe copy's check, on a disk that stops answering); meanwhile an
    ``O_TRUNC`` writer wrote a longer version and sealed it, so the kernel's size for the inode
    became the new one. Registering the old copy then would give a descriptor whose ``fstat``
    says 10 MiB over a 6 MiB backing file: reads past 6 MiB EOF, a mapping SIGBUS. The open is
    served by the daemon instead: the old version's bytes, then zeros up to the size it is told
    (docs/design.md, "Versions and sizes" and "How a read travels")."""
    old, new = content("old", 6 * MiB), content("new", 10 * MiB)
    m, lower, p = _on_nvme_behind_a_stoppable_disk(kvfs_mount, tmp_path, old)
    before = transport(m)["passthrough"]
    rd = _open_while_replaced(m, lower, p, new)
    try:
        assert os.fstat(rd).st_size == len(new)
        assert os.pread(rd, 2 * MiB, 0) == old[:2 * MiB]
        assert os.pread(rd, MiB, 7 * MiB) == bytes(MiB)         # zeros inside fstat's size, not EOF
        code = ("import mmap, os, sys; fd = int(sys.argv[1]); n = os.fstat(fd).st_size; "
                "mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ); "
                "sys.stdout.write('%d %d' % (mm[:6 << 20] == sys.stdin.buffer.read(), any(mm[6 << 20:])))")
        res = subprocess.run([sys.executable, "-c", code, str(rd)], pass_fds=(rd,), input=old,
                             capture_output=True, timeout=120)
        assert res.returncode == 0, f"the mapping faulted inside fstat's size (rc {res.returncode})"
        assert res.stdout == b"1 0"
        pt = transport(m)["passthrough"]
        assert pt["opens"] == before["opens"] and pt["held"] == 0, "the replaced version was registered"
    finally:
        os.close(rd)
    assert read(p) == new
    m.umount()                                       # before the filesystem under its NVMe tier goes


def test_a_read_only_open_whose_version_was_replaced_and_registered_reads_the_new_one(kvfs_mount, tmp_path):
    """The same wait, and meanwhile a second reader opened the new version and the kernel
    got it as the inode's backing file: the kernel then takes no other kind of open of the
    inode, so the first open, still in flight, cannot be served the old version. It was
    refused with ETXTBSY (tests/fsx/probe_concurrent.py, about one per few minutes); it is
    opened again instead and reads the current version — its open had not returned, so
    that is the version it opened."""
    old, new = content("old", 6 * MiB), content("new", 10 * MiB)
    m, lower, p = _on_nvme_behind_a_stoppable_disk(kvfs_mount, tmp_path, old)
    second = []
    rd = _open_while_replaced(m, lower, p, new, then=lambda: second.append(os.open(p, os.O_RDONLY)))
    try:
        assert transport(m)["passthrough"]["held"] == 1      # the second reader's backing
        assert os.fstat(rd).st_size == len(new)
        assert os.pread(rd, len(new) + 1, 0) == new
        assert os.pread(second[0], len(new) + 1, 0) == new
    finally:
        os.close(rd)
        for fd in second:
            os.close(fd)
    m.umount()


def test_seed_802_old_reader_of_a_file_unlinked_while_written_maps_to_fstat_size(kvfs_mount):
    """The SIGBUS of ``FSX_SEEDS=802 FSX_OPS=30000`` with passthrough on, cut down to its file
    (operations 4465 to 4559 of f19): a reader of an empty sealed version, then a writer that
    writes, unlinks, shrinks and extends the file and closes. The reader is an older version's
    (the daemon serves it; no passthrough here), told the writer's size: it reads zeros up to
    it, and a mapping of that size does not fault (it read EOF, and faulted, with passthrough
    off too: the orphan's seal, docs/design.md "Versions and sizes")."""
    m = kvfs_mount("--passthrough", ram="4MiB", nvme_size="64MiB")
    p = m.path / "f19"
    os.close(os.open(p, os.O_RDONLY | os.O_CREAT, 0o644))
    rd = os.open(p, os.O_RDONLY)
    try:
        wr = os.open(p, os.O_RDWR)
        os.pwrite(wr, content("a", 5242), 219616)
        os.unlink(p)
        os.ftruncate(wr, 150457)
        os.pwrite(wr, content("b", 10698), 482700)
        os.close(wr)
        assert os.fstat(rd).st_size == 493398
        assert os.pread(rd, 41668, 316859) == bytes(41668)
        code = ("import mmap, os, sys; fd = int(sys.argv[1]); n = os.fstat(fd).st_size; "
                "mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ); print(any(mm[:]))")
        res = subprocess.run([sys.executable, "-c", code, str(rd)], pass_fds=(rd,), capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, f"the mapping faulted inside fstat's size (rc {res.returncode})"
        assert res.stdout.strip() == "False"
    finally:
        os.close(rd)


def test_no_backing_while_a_direct_io_open_may_not_be_applied(kvfs_mount):
    """The kernel refuses every open of an inode that is not passthrough once the inode has a
    backing file (EIO at ``open(2)``: found by tests/fsx/probe_concurrent.py, 1-2 per 30 s run).
    The daemon answers OPENs in one order, but each opener applies its answer when it next
    runs: a reader answered ``direct_io`` (another version of the file was open) whose process
    ran after a second reader's passthrough answer got EIO. So no backing is registered while
    a ``direct_io`` answer of the inode has not been seen in use (a READ, WRITE or FLUSH of
    its handle: its opener ran), and one is once it has."""
    m = kvfs_mount("--passthrough", ram="64MiB")
    p = m.path / "f.kv"
    p.write_bytes(content("v1", MiB))
    w = os.open(p, os.O_RDWR)
    os.pwrite(w, b"v2" * 500, MiB)
    a = os.open(p, os.O_RDONLY)              # joins the writer's buffer: the version it seals
    os.close(w)
    b = os.open(p, os.O_RDONLY)              # the sealed version while (a) is open: direct_io
    try:
        os.close(a)
        wait_for(lambda: m.stats()["open_handles"] == 1, 60, "the RELEASE of (a)")
        before = opens(m)
        c = os.open(p, os.O_RDONLY)          # (b) not seen yet: no backing for the inode
        os.close(c)
        assert opens(m) == before, "a backing was registered beside a direct_io open not yet applied"
        wait_for(lambda: m.stats()["open_handles"] == 1, 60, "the RELEASE of (c)")
        assert os.pread(b, 4, MiB) == b"v2v2"   # (b) in use: its open was applied
        d = os.open(p, os.O_RDONLY)
        try:
            assert os.pread(d, 4, MiB) == b"v2v2"
        finally:
            os.close(d)
        assert opens(m) == before + 1, "the reader after (b)'s first read was not given passthrough"
    finally:
        os.close(b)


def test_the_request_trace_says_what_each_answer_was(kvfs_mount, tmp_path, monkeypatch):
    """``KVFS_TRACE_REQUESTS=FILE`` (docs/testing.md): a line per answered request, with an
    open's flags and backing id; a path that cannot be opened leaves the mount without one."""
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("KVFS_TRACE_REQUESTS", str(trace))
    m = kvfs_mount("--passthrough", ram="64MiB")
    p = m.path / "f.kv"
    p.write_bytes(content("t", MiB))
    assert read(p) == content("t", MiB)
    wait_for(lambda: m.stats()["open_handles"] == 0, 60, "the RELEASEs")
    lines = trace.read_text().splitlines()
    ops = [line.split()[2] for line in lines]
    assert {"create", "write", "flush", "open", "release"} <= set(ops)
    node = f"node={os.stat(p).st_ino}"
    opened = [line for line in lines if line.split()[2:4] == ["open", node]]
    assert opened and "backing=0" not in opened[-1] and "open_flags=0xa0" in opened[-1]
    monkeypatch.setenv("KVFS_TRACE_REQUESTS", str(tmp_path / "no" / "such" / "dir" / "t"))
    m2 = kvfs_mount(ram="64MiB")
    (m2.path / "g.kv").write_bytes(b"x")
    assert read(m2.path / "g.kv") == b"x"
    assert "no request trace" in m2.log_tail()
