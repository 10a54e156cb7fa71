"""Issue 40, items 2 and 3, as a hostile tenant on an ``--allow-other`` mount: once it holds
grants on both tiers (its ``<grants>/<uid>/`` directories exist), it tries to create, write,
chmod, rename, link, mkdir, mkfifo and symlink in every directory under the daemon's storage
(the RAM tier's tmpfs, the NVMe directory, the state directory) and to write, truncate, chmod
and rename every file there it can reach: all refused, nothing added, no byte of any tier
taken. (In earlier versions it owned its ``<uid>/``: chmod made it writable.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.files import MiB, content
from support.mount import wait_for
from support.users import reachable

pytestmark = pytest.mark.mount

# as the tenant: argv = a JSON list of directories and a JSON list of files; every attempt that
# succeeds is reported (the empty list is the only right answer), with what was refused by errno
ATTACK = r"""
import errno, json, os, sys
dirs, files = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ok, refused = [], {}
def attempt(what, fn, *a):
    try:
        fn(*a)
        ok.append(what)
    except OSError as e:
        refused[errno.errorcode[e.errno]] = refused.get(errno.errorcode[e.errno], 0) + 1
def create(p):
    os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
def fill(p):
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"x" * (1 << 20))
    finally:
        os.close(fd)
def chmod_create(d):
    os.chmod(d, 0o700)
    create(os.path.join(d, "t-after-chmod"))
def write_into(p):
    fd = os.open(p, os.O_WRONLY)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)
for d in dirs:
    attempt(f"create {d}", create, os.path.join(d, "t-file"))
    attempt(f"fill {d}", fill, os.path.join(d, "t-fill"))
    attempt(f"mkdir {d}", os.mkdir, os.path.join(d, "t-dir"))
    attempt(f"mkfifo {d}", os.mkfifo, os.path.join(d, "t-fifo"))
    attempt(f"symlink {d}", os.symlink, "/", os.path.join(d, "t-link"))
    attempt(f"chmod {d}", os.chmod, d, 0o777)
    attempt(f"chmod and create {d}", chmod_create, d)
    attempt(f"rename {d}", os.rename, d, d + "-moved")
    for f in files[:1]:
        attempt(f"hardlink into {d}", os.link, f, os.path.join(d, "t-hard"))
    try:
        names = os.listdir(d)
    except OSError:
        names = []
    for n in names[:4]:
        attempt(f"rename in {d}", os.rename, os.path.join(d, n), os.path.join(d, n + "-moved"))
        attempt(f"unlink in {d}", os.unlink, os.path.join(d, n))
for f in files:
    attempt(f"write {f}", write_into, f)
    attempt(f"truncate {f}", os.truncate, f, 0)
    attempt(f"chmod {f}", os.chmod, f, 0o666)
    attempt(f"rename {f}", os.rename, f, "/tmp/t-stolen")
print(json.dumps({"ok": ok, "refused": refused}))
"""

LEASE = r"""
import json, os, sys
m, paths = sys.argv[1], sys.argv[2:]
fd = os.open(m + "/.kvfs/lease", os.O_RDWR)
os.pwrite(fd, "".join(p + "\n" for p in paths).encode(), 0)
print(os.pread(fd, 1 << 20, 0).decode())
"""


def tree(root) -> tuple[list[str], list[str]]:
    """Every directory and regular file under ``root`` (as root sees them), ``root`` included."""
    dirs, files = [str(root)], []
    for top, ds, fs in os.walk(root):
        dirs += [os.path.join(top, d) for d in ds]
        files += [os.path.join(top, f) for f in fs]
    return dirs, files


def used(path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_tenant_can_add_nothing_under_the_daemons_storage(kvfs_mount, tenant):
    m = kvfs_mount(ram="8MiB", nvme_size="64MiB", allow_other=True)
    ns = m.path / "team"
    ns.mkdir(mode=0o700)
    os.chown(ns, tenant.uid, tenant.gid)
    names = ["team/b0", "team/filler", "team/b1"]
    for n, size in zip(names, (MiB, 6 * MiB, MiB)):       # b0 and the filler go down to NVMe
        (m.path / n).write_bytes(content(n, size))
        os.chown(m.path / n, tenant.uid, tenant.gid)
    wait_for(lambda: m.stats()["settled"], 120, "the store to settle")
    tiers = {os.getxattr(m.path / n, "user.kvfs.tier").decode() for n in names}
    assert tiers == {"ram", "nvme"}, tiers
    with reachable(m.path):
        ans = json.loads(tenant.run(LEASE, m.path, names[0], names[2]).stdout)
    leased = [b[1] for b in ans["blocks"] if b]
    assert len(leased) == 2, ans           # the tenant holds grants on both tiers

    ram_fs = os.path.dirname(m.stats()["ram_dir"])      # the RAM tier's own tmpfs (or shm_dir)
    dirs, files = [], []
    for root in (ram_fs if os.path.ismount(ram_fs) else m.stats()["ram_dir"], m.nvme, m.state):
        d, f = tree(root)
        dirs += d
        files += f
    assert {os.path.dirname(p) for p in leased} <= set(dirs)
    before = {root: used(root) for root in (ram_fs, m.nvme)}
    listing = sorted(dirs + files)

    with reachable(m.path), reachable(m.nvme.parent), reachable(m.state.parent):
        res = tenant.run(ATTACK, json.dumps(dirs), json.dumps(leased + files))
    got = json.loads(res.stdout)
    assert got["ok"] == [], got["ok"][:20]
    assert set(got["refused"]) <= {"EACCES", "EPERM", "ENOENT", "EXDEV", "EBUSY"}, got["refused"]
    after_dirs, after_files = [], []
    for root in (ram_fs if os.path.ismount(ram_fs) else m.stats()["ram_dir"], m.nvme, m.state):
        d, f = tree(root)
        after_dirs += d
        after_files += f
    assert set(after_dirs + after_files) <= set(listing)     # nothing added, nothing renamed
    assert not any(os.path.basename(p).startswith("t-") or p.endswith("-moved")
                   for p in after_dirs + after_files)
    for root, b in before.items():
        assert used(root) <= b + MiB, f"{root}: {(used(root) - b) / MiB:.1f} MiB more after the attack"
    for n, size in zip(names, (MiB, 6 * MiB, MiB)):
        assert (m.path / n).read_bytes() == content(n, size)


def test_umount_removes_a_planted_tree_in_the_ram_grants_and_its_tmpfs(kvfs_mount, tenant, tmp_path):
    """Issue 40, item 2: a 1,600-level tree, symlinks out and a fifo in the RAM tier's grants
    directory (planted by root, as a tenant of an earlier version could) leave neither the
    daemon's tmpfs mounted nor ``kvfs umount`` failing."""
    from support.planted import plant
    m = kvfs_mount(ram="8MiB", allow_other=True)
    ns = m.path / "team"
    ns.mkdir(mode=0o700)
    os.chown(ns, tenant.uid, tenant.gid)
    (ns / "b0").write_bytes(content("b0", MiB))
    os.chown(ns / "b0", tenant.uid, tenant.gid)
    with reachable(m.path):
        ans = json.loads(tenant.run(LEASE, m.path, "team/b0").stdout)
    assert ans["blocks"][0] and ans["blocks"][0][0] == "ram", ans
    udir = os.path.dirname(ans["blocks"][0][1])
    outside = plant(Path(udir) / "deep", outside=tmp_path / "out")
    ram_fs = os.path.dirname(m.stats()["ram_dir"])
    m.umount()
    assert not os.path.lexists(os.path.dirname(udir))
    assert not any(ram_fs in line for line in open("/proc/self/mounts"))
    assert (outside / "precious").read_bytes() == b"keep me"
