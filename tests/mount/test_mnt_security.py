"""Security and isolation on a shared node, each attack replayed by a real second user.

A regression test per finding: the RAM tier's directory cannot be steered by another
user, the index holds no code, two mounts never share an NVMe or state directory, the
control files answer a caller only about what it could read, a damaged index is refused
(and rebuilt by fsck), and bad control-file numbers are refused.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest

from support.files import MiB, content, put, read
from support.mount import run_kvfs
from support.store import plant_record
from support.users import reachable

pytestmark = pytest.mark.mount


def ask(path: Path, request: bytes) -> dict:
    """One request on a control file, as the calling process."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, request, 0)
        return json.loads(os.pread(fd, 1 << 20, 0))
    finally:
        os.close(fd)


def mount_fails(m) -> str:
    """Mount ``m`` again, expecting a refusal; returns the one-line error."""
    res = run_kvfs("mount", m.path, *m.args)
    assert res.returncode != 0, f"mount unexpectedly succeeded\n{res.stdout}"
    err = res.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not os.path.ismount(m.path)
    return err


# ---- 1. the RAM tier's directory ------------------------------------------------------
def test_ram_dir_is_fresh_private_and_unpredictable(kvfs_mount):
    m = kvfs_mount()
    st = m.stats()
    d = Path(st["ram_dir"])
    info = os.lstat(d)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert d.name != f"kvfs-{st['instance']}" and d.name.startswith(f"kvfs-{st['instance']}-")
    first = d
    m.remount()
    assert Path(m.stats()["ram_dir"]) != first, "a remount reuses the RAM directory's name"
    assert not first.exists()


def test_planted_symlinks_in_shm_cannot_steer_writes(kvfs_mount, intruder, tmp_path):
    m = kvfs_mount()
    put(m.path / "seed.bin", b"x" * 4096)
    instance = m.stats()["instance"]
    m.umount()
    victim = tmp_path / "root-only"
    victim.write_bytes(b"secret" * 100)
    os.chmod(victim, 0o600)
    target = intruder.home / "x"
    # the old name and a guess at a new one, both pointing into the intruder's directory
    intruder.run("import os,sys; os.mkdir(sys.argv[1]);"
                 "[os.symlink(sys.argv[1], f'/dev/shm/kvfs-{sys.argv[2]}{s}') for s in ('', '-', '-guess')]",
                 target, instance)
    try:
        m.mount()
        ram_dir = Path(m.stats()["ram_dir"])
        # in /dev/shm, or in the daemon's own tmpfs there (kvfs.store.hugefs): no link on the way
        assert str(ram_dir).startswith("/dev/shm/") and not any(
            p.is_symlink() for p in (ram_dir, *ram_dir.parents))
        assert ram_dir.parent == Path("/dev/shm") or ".hugefs-" in ram_dir.parent.name
        for i in range(8):
            put(m.path / f"f{i}.bin", content(f"f{i}", 256 << 10))
        assert os.listdir(target) == [], "the daemon created something in the intruder's directory"
        # the intruder cannot look into (or replace anything inside) the daemon's directory
        res = intruder.run("import os,sys; os.listdir(sys.argv[1])", ram_dir, check=False)
        assert res.returncode != 0 and "PermissionError" in res.stderr
        res = intruder.run("import os,sys; os.symlink(sys.argv[2], sys.argv[1] + '/staging/w0')",
                           ram_dir, victim, check=False)
        assert res.returncode != 0
        for i in range(8):
            assert read(m.path / f"f{i}.bin") == content(f"f{i}", 256 << 10)
        assert victim.read_bytes() == b"secret" * 100
        # the planted links are left alone (not ours), never followed or removed
        assert os.path.islink(f"/dev/shm/kvfs-{instance}")
    finally:
        for s in ("", "-", "-guess"):
            try:
                os.unlink(f"/dev/shm/kvfs-{instance}{s}")
            except FileNotFoundError:
                pass


def test_ram_dir_removed_under_the_mount_is_recreated(kvfs_mount):
    m = kvfs_mount()
    put(m.path / "before.bin", content("before", 2 * MiB))
    old = Path(m.stats()["ram_dir"])
    shutil.rmtree(old)
    put(m.path / "after.bin", content("after", 2 * MiB))
    assert read(m.path / "after.bin") == content("after", 2 * MiB)
    assert read(m.path / "before.bin") == content("before", 2 * MiB)
    new = Path(m.stats()["ram_dir"])
    assert new != old and new.is_dir()


# ---- 2. the index holds no code; state is private ---------------------------------------
class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_record_is_refused_not_run(kvfs_mount, kvfs_cli, tmp_path):
    m = kvfs_mount()
    put(m.path / "keep.bin", content("keep", 1 * MiB))
    m.umount()
    marker = tmp_path / "pwned"
    plant_record(m.state, b"inodes", (1 << 40).to_bytes(8, "big"), pickle.dumps(_Payload(marker)))
    err = mount_fails(m)
    assert "kvfs fsck" in err
    res = kvfs_cli("fsck", "--nvme", m.nvme, "--state", m.state)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert not marker.exists(), "an index record ran code"
    res = kvfs_cli("fsck", "--nvme", m.nvme, "--state", m.state, "--repair")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not marker.exists()
    m.mount()
    assert read(m.path / "keep.bin") == content("keep", 1 * MiB)


def test_state_and_nvme_directories_are_private(kvfs_mount, intruder):
    m = kvfs_mount()
    put(m.path / "secret-name.bin", b"x" * 8192)
    os.setxattr(m.path / "secret-name.bin", "user.note", b"private value")
    for d in (m.state, m.nvme, m.state / "index.lmdb"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for f in (m.state / "index.lmdb" / "data.mdb", m.state / "kvfs.log", m.state / "index.hdr"):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    with reachable(m.state):
        res = intruder.run("open(__import__('sys').argv[1], 'rb').read()",
                           m.state / "index.lmdb" / "data.mdb", check=False)
    assert res.returncode != 0 and "PermissionError" in res.stderr


# ---- 3. one owner per NVMe and state directory ----------------------------------------
def test_a_second_mount_of_an_nvme_directory_is_refused(kvfs_mount, tmp_path):
    a = kvfs_mount(ram="16MiB")
    for i in range(12):
        put(a.path / f"b{i}.bin", content(f"b{i}", 2 * MiB))
    other = tmp_path / "other"
    other.mkdir()
    (other / "mnt").mkdir()
    res = run_kvfs("mount", other / "mnt", "--nvme", a.nvme, "--state", other / "state",
                   "--ram", "16MiB", "--nvme-size", "1GiB")
    assert res.returncode != 0 and not os.path.ismount(other / "mnt")
    err = res.stderr.strip()
    assert "in use by kvfs pid" in err and str(a.pid) in err and str(a.path) in err, err
    # not even after the first unmounts: the directory belongs to the first index
    a.umount()
    res = run_kvfs("mount", other / "mnt", "--nvme", a.nvme, "--state", other / "state",
                   "--ram", "16MiB", "--nvme-size", "1GiB")
    assert res.returncode != 0 and not os.path.ismount(other / "mnt")
    assert "holds the objects of kvfs instance" in res.stderr, res.stderr
    a.mount()
    for i in range(12):
        assert read(a.path / f"b{i}.bin") == content(f"b{i}", 2 * MiB)


def test_a_copied_state_directory_is_refused(kvfs_mount, tmp_path):
    a = kvfs_mount()
    put(a.path / "a.bin", content("a", 2 * MiB))
    ram_dir = Path(a.stats()["ram_dir"])
    copy = tmp_path / "state-copy"
    shutil.copytree(a.state, copy, ignore=shutil.ignore_patterns("lock"))
    (tmp_path / "m2").mkdir()
    # same NVMe directory: locked by the first mount
    res = run_kvfs("mount", tmp_path / "m2", "--nvme", a.nvme, "--state", copy, "--ram", "16MiB")
    assert res.returncode != 0 and "in use by kvfs pid" in res.stderr, res.stderr
    # a fresh NVMe directory: the copy's index is bound to the first one's objects
    res = run_kvfs("mount", tmp_path / "m2", "--nvme", tmp_path / "nvme2", "--state", copy, "--ram", "16MiB")
    assert res.returncode != 0 and not os.path.ismount(tmp_path / "m2")
    assert "copied state directory" in res.stderr, res.stderr
    assert ram_dir.is_dir() and Path(a.stats()["ram_dir"]) == ram_dir
    assert read(a.path / "a.bin") == content("a", 2 * MiB)


# ---- 4. control files answer as the caller ----------------------------------------------
LOOKUP_AS = """
import json, os, sys
def ask(f, req):
    fd = os.open(f, os.O_RDWR)
    os.pwrite(fd, req.encode(), 0)
    out = os.pread(fd, 1 << 20, 0)
    os.close(fd)
    return json.loads(out)
m = sys.argv[1]
print(json.dumps({
  "lookup_private": ask(m + "/.kvfs/lookup", "private/f.bin\\n")["prefix"],
  "lookup_public": ask(m + "/.kvfs/lookup", "public/f.bin\\n")["prefix"],
  "lease_private": ask(m + "/.kvfs/lease", "private/f.bin\\n"),
  "lookup_mixed": ask(m + "/.kvfs/lookup", "public/f.bin\\nprivate/f.bin\\n")["prefix"],
  "lookup_0600": ask(m + "/.kvfs/lookup", "public/mine-only.bin\\n")["prefix"],
}))
"""

LEASE_MANY = """
import json, os, sys
m, n = sys.argv[1], int(sys.argv[2])
fds, pinned = [], []
names = "".join(f"big/{i}.bin\\n" for i in range(8)).encode()
for i in range(n):
    fd = os.open(m + "/.kvfs/lease", os.O_RDWR)
    os.pwrite(fd, names, 0)
    ans = json.loads(os.pread(fd, 1 << 20, 0))
    pinned.append(sum(1 for b in ans["blocks"] if b is not None))
    fds.append(fd)
st = json.loads(open(m + "/.kvfs/stats").read())
print(json.dumps({"pinned": pinned, "leases": st["leases"], "ttl": ans["ttl"]}))
"""


def test_control_files_answer_only_what_the_caller_could_read(kvfs_mount, intruder):
    m = kvfs_mount(allow_other=True)
    (m.path / "private").mkdir(mode=0o700)
    (m.path / "public").mkdir(mode=0o755)
    put(m.path / "private" / "f.bin", b"p" * 8192)
    put(m.path / "public" / "f.bin", b"q" * 8192)
    os.chmod(m.path / "public" / "f.bin", 0o644)
    put(m.path / "public" / "mine-only.bin", b"r" * 8192)
    os.chmod(m.path / "public" / "mine-only.bin", 0o600)
    with reachable(m.path):
        res = intruder.run(LOOKUP_AS, m.path)
    got = json.loads(res.stdout)
    assert got["lookup_private"] == 0 and got["lookup_public"] == 1
    assert got["lookup_mixed"] == 1 and got["lookup_0600"] == 0
    lease = got["lease_private"]
    assert lease["prefix"] == 0 and lease["blocks"] == []
    # root still sees everything
    assert ask(m.path / ".kvfs" / "lookup", b"private/f.bin\npublic/mine-only.bin\n")["prefix"] == 2


def test_a_users_leases_are_bounded(kvfs_mount, intruder):
    m = kvfs_mount(ram="64MiB", allow_other=True)
    (m.path / "big").mkdir(mode=0o755)
    for i in range(8):
        put(m.path / "big" / f"{i}.bin", content(f"big{i}", 4 * MiB))
        os.chmod(m.path / "big" / f"{i}.bin", 0o644)
    os.chown(m.path / "big", intruder.uid, intruder.gid)   # its namespace: its blocks get paths
    with reachable(m.path):
        res = intruder.run(LEASE_MANY, m.path, 80)
    got = json.loads(res.stdout)
    assert got["leases"] <= 64, got["leases"]              # LEASES_PER_USER
    assert max(got["pinned"]) == 4                           # a quarter of 64 MiB in 4 MiB blocks
    assert got["ttl"] <= 60


@pytest.mark.parametrize("ttl", [b"nan", b"inf", b"-1", b"0", b"601", b"1e999", b"x"])
def test_bad_lease_ttls_are_refused(kvfs_mount, ttl):
    m = kvfs_mount()
    put(m.path / "f.bin", b"x" * 4096)
    with pytest.raises(OSError) as e:
        ask(m.path / ".kvfs" / "lease", b"\0ttl " + ttl + b"\nf.bin\n")
    assert e.value.errno == errno.EINVAL
    assert m.stats()["leases"] == 0


# ---- 5. a damaged index is refused, never swept, and fsck rebuilds it ---------------------
def _fill(m, n=6):
    for i in range(n):
        put(m.path / "d" / f"{i}.bin", content(f"d{i}", 3 * MiB))


def _objects(m) -> list[Path]:
    return sorted(p for p in (m.nvme / "objects").rglob("*") if p.is_file())


@pytest.mark.parametrize("damage", ["half", "zero", "missing"])
def test_a_damaged_index_is_refused_then_rebuilt(kvfs_mount, kvfs_cli, damage):
    m = kvfs_mount(ram="32MiB")
    _fill(m)
    m.umount()                               # writes every RAM-only object down to NVMe
    before = _objects(m)
    assert len(before) == 6
    data = m.state / "index.lmdb" / "data.mdb"
    if damage == "half":
        os.truncate(data, os.path.getsize(data) // 2)
    elif damage == "zero":
        os.truncate(data, 0)
    else:
        shutil.rmtree(m.state / "index.lmdb")
    err = mount_fails(m)
    assert "kvfs fsck" in err, err
    assert _objects(m) == before, "a refused mount touched the objects"
    res = kvfs_cli("fsck", "--nvme", m.nvme, "--state", m.state)
    assert res.returncode == 1 and "index damaged" in res.stdout, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "Bus error" not in res.stderr
    res = kvfs_cli("fsck", "--nvme", m.nvme, "--state", m.state, "--repair")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rebuilt 6 index entries" in res.stdout
    m.mount()
    for i in range(6):
        assert read(m.path / "d" / f"{i}.bin") == content(f"d{i}", 3 * MiB)
    res = kvfs_cli("fsck", "--nvme", m.nvme, "--state", m.state)     # mounted: refused, clearly
    assert res.returncode != 0 and "in use" in res.stderr
