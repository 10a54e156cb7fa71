"""Issue 40, item 3: what a tenant holds is charged to its namespace's quota. A file removed
(unlinked, or replaced by a rename) while a descriptor or a lease holds it keeps its bytes in
the tier until released; until then they count against the namespace it was in, so a tenant
cannot fill a tier past its quota by writing, holding and unlinking, over and over."""
from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from support.mount import run_kvfs, wait_for
from support.users import reachable

pytestmark = pytest.mark.mount

MiB = 1 << 20

# as the tenant: ROUNDS times {write 1 MiB; hold it (a descriptor, a lease, or a rename over
# it while open); remove it}; report each round's errno; wait for a line; release everything;
# write one more file and report its errno
HOLD = r"""
import errno, json, os, sys
m, ns, rounds, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
d = os.path.join(m, ns)
kept, out = [], []
for i in range(rounds):
    p = os.path.join(d, f"f{i}")
    try:
        with open(p, "wb") as f:
            f.write(os.urandom(1 << 20))
    except OSError as e:
        out.append(e.errno)
        continue
    out.append(0)
    if how == "lease":
        fd = os.open(m + "/.kvfs/lease", os.O_RDWR)
        os.pwrite(fd, f"{ns}/f{i}\n".encode(), 0)
        os.pread(fd, 1 << 16, 0)
        kept.append(fd)
    else:
        kept.append(os.open(p, os.O_RDONLY))
    if how == "rename":
        open(p + ".new", "wb").close()       # empty: the held bytes alone reach the quota
        os.rename(p + ".new", p)
        os.unlink(p)
    else:
        os.unlink(p)
print(json.dumps(out), flush=True)
sys.stdin.readline()
for fd in kept:
    os.close(fd)
try:
    with open(os.path.join(d, "after"), "wb") as f:
        f.write(os.urandom(1 << 20))
    print(json.dumps(0), flush=True)
except OSError as e:
    print(json.dumps(e.errno), flush=True)
"""


@pytest.mark.parametrize("how", ["open", "lease", "rename"])
def test_removed_but_held_files_count_against_the_quota(kvfs_mount, tenant, how):
    m = kvfs_mount(ram="64MiB", nvme_size="128MiB", allow_other=True)
    ns = m.path / "team"
    ns.mkdir(mode=0o700)
    os.chown(ns, tenant.uid, tenant.gid)
    assert run_kvfs("quota", "set", m.path, "team", "4MiB").returncode == 0
    base = m.stats()["tiers"]["ram"]["used"]
    with reachable(m.path):
        p = subprocess.Popen([tenant.python, "-c", HOLD, str(m.path), "team", "8", how],
                             user=tenant.uid, group=tenant.gid, extra_groups=[], cwd="/", text=True,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(tenant.home)},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            rounds = json.loads(line)
            held = m.stats()["tiers"]["ram"]["used"] - base
            charged = m.stats()["quotas"]["limits"]["team"]
            p.stdin.write("\n")
            p.stdin.flush()
            after = json.loads(p.stdout.readline())
        finally:
            p.kill()
            p.wait()
    # 4 files of 1 MiB reach the quota exactly; the 5th and later go past it while 4 are held
    assert rounds == [0] * 4 + [errno.EDQUOT] * 4, rounds
    assert held <= 4 * MiB + 64 * 1024, f"{held / MiB:.1f} MiB held in RAM for a 4 MiB quota"
    assert charged["used"] == charged["held"] == 4 * MiB, charged
    # released: the charge goes with the bytes
    assert after == 0
    wait_for(lambda: m.stats()["quotas"]["limits"]["team"]["held"] == 0, 60, "the held bytes to be freed")
    assert m.stats()["quotas"]["limits"]["team"]["used"] == MiB


# as the tenant: open ROUNDS files and write 1 MiB to each, keeping every one open (nothing is
# sealed); report each write's errno; wait for a line; close them all
WRITING = r"""
import json, os, sys
d, rounds = sys.argv[1], int(sys.argv[2])
kept, out = [], []
for i in range(rounds):
    fd = os.open(os.path.join(d, f"w{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    kept.append(fd)
    try:
        os.write(fd, os.urandom(1 << 20))
        out.append(0)
    except OSError as e:
        out.append(e.errno)
print(json.dumps(out), flush=True)
sys.stdin.readline()
errs = []
for fd in kept:
    try:
        os.close(fd)
        errs.append(0)
    except OSError as e:
        errs.append(e.errno)
print(json.dumps(errs), flush=True)
"""


def test_files_being_written_count_against_the_quota_while_open(kvfs_mount, tenant):
    """Buffers of files held open for writing are what the tenant holds too: with 4 of 1 MiB
    open and unsealed in a 4 MiB namespace, a fifth gets EDQUOT (at the quota, then past)."""
    m = kvfs_mount(ram="64MiB", nvme_size="128MiB", allow_other=True)
    ns = m.path / "team"
    ns.mkdir(mode=0o700)
    os.chown(ns, tenant.uid, tenant.gid)
    assert run_kvfs("quota", "set", m.path, "team", "4MiB").returncode == 0
    base = m.stats()["tiers"]["ram"]["used"]
    with reachable(m.path):
        p = subprocess.Popen([tenant.python, "-c", WRITING, str(ns), "8"],
                             user=tenant.uid, group=tenant.gid, extra_groups=[], cwd="/", text=True,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(tenant.home)},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            rounds = json.loads(line)
            staged = m.stats()["tiers"]["ram"]["used"] - base
            p.stdin.write("\n")
            p.stdin.flush()
            closed = json.loads(p.stdout.readline())
        finally:
            p.kill()
            p.wait()
    assert rounds == [0] * 4 + [errno.EDQUOT] * 4, rounds
    assert staged <= 4 * MiB + 64 * 1024, f"{staged / MiB:.1f} MiB staged in RAM for a 4 MiB quota"
    assert closed[:4] == [0] * 4, closed
    wait_for(lambda: m.stats()["settled"], 60, "the store to settle")
    assert m.stats()["quotas"]["limits"]["team"]["used"] <= 4 * MiB


def test_a_truncate_up_past_the_quota_is_refused(kvfs_mount):
    """A truncate that grows a file adds bytes to its namespace like a write (a sealed file is
    stored at its full size): at the quota it is allowed, past it EDQUOT, and nothing grows."""
    m = kvfs_mount(ram="64MiB", nvme_size="128MiB")
    ns = m.path / "team"
    ns.mkdir()
    assert run_kvfs("quota", "set", m.path, "team", "4MiB").returncode == 0
    with open(ns / "a", "wb") as f:
        f.write(b"x" * MiB)
    os.truncate(ns / "a", 4 * MiB)                     # at the quota
    with pytest.raises(OSError) as e:
        os.truncate(ns / "a", 4 * MiB + 1)             # past it
    assert e.value.errno == errno.EDQUOT
    with open(ns / "b", "wb") as f:
        with pytest.raises(OSError) as e:
            os.ftruncate(f.fileno(), 64 * MiB)
        assert e.value.errno == errno.EDQUOT
    assert os.path.getsize(ns / "a") == 4 * MiB and os.path.getsize(ns / "b") == 0
    wait_for(lambda: m.stats()["settled"], 60, "the store to settle")
    assert m.stats()["quotas"]["limits"]["team"]["used"] <= 4 * MiB
    assert m.stats()["tiers"]["ram"]["used"] + m.stats()["tiers"]["nvme"]["used"] <= 8 * MiB
