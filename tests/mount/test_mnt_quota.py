"""Namespace quotas with two real users: root sets them, a tenant's writes past its quota evict
its own least recently used files, then get EDQUOT; another namespace is not touched."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from support.files import content, put, read
from support.mount import run_kvfs

from support.users import reachable

pytestmark = pytest.mark.mount

MB = 1_000_000

# as the tenant: write files (name, size) in order, reading one back in between; print errnos
TENANT = r"""
import json, os, sys
d, plan = sys.argv[1], json.loads(sys.argv[2])
out = {}
for step in plan:
    if step[0] == "read":
        with open(os.path.join(d, step[1]), "rb") as f:
            f.read()
        continue
    name, size = step
    try:
        with open(os.path.join(d, name), "wb") as f:
            f.write(bytes([len(name)]) * size)
        out[name] = 0
    except OSError as e:
        out[name] = e.errno
try:
    os.setxattr(d, "user.kvfs.quota", b"1GiB")
    out["setxattr"] = 0
except OSError as e:
    out["setxattr"] = e.errno
print(json.dumps(out))
"""


def test_a_tenant_past_its_quota_evicts_its_own_lru_then_gets_edquot(kvfs_mount, intruder):
    m = kvfs_mount(allow_other=True, metrics="127.0.0.1:0")
    ta, tb = m.path / "tenant-a", m.path / "tenant-b"
    ta.mkdir()
    tb.mkdir()
    os.chown(ta, intruder.uid, intruder.gid)
    res = run_kvfs("quota", "set", m.path, "tenant-a", "3.5MiB")
    assert res.returncode == 0, res.stderr
    (tb / "other").write_bytes(content("other", 5 * MB))        # no quota there
    plan = [["f0", MB], ["f1", MB], ["f2", MB], ["read", "f0"], ["f3", MB]]
    with reachable(m.path):
        got = json.loads(intruder.run(TENANT, ta, json.dumps(plan)).stdout)
    assert got["f0"] == got["f1"] == got["f2"] == got["f3"] == 0
    assert got["setxattr"] == errno.EPERM                     # only root sets quotas
    assert sorted(p.name for p in ta.iterdir()) == ["f0", "f2", "f3"]   # f1: least recently used
    for n in ("f0", "f2", "f3"):
        assert read(ta / n) == bytes([2]) * MB, n
    st = m.stats()["quotas"]
    assert st["evicted"] == 1 and st["refused"] == 0
    # one write(2) larger than the quota (it reaches the daemon as 1 MiB requests): EDQUOT,
    # and the tenant's idle files are all still there (issue 34: they were evicted first);
    # the refused file is evicted at close, so the namespace is back within its quota
    with reachable(m.path):
        got = json.loads(intruder.run(TENANT, ta, json.dumps([["big", 4 * MB]])).stdout)
    assert got["big"] == errno.EDQUOT
    assert sorted(p.name for p in ta.iterdir()) == ["f0", "f2", "f3"]
    for n in ("f0", "f2", "f3"):
        assert read(ta / n) == bytes([2]) * MB, n
    assert read(tb / "other") == content("other", 5 * MB)     # another namespace: untouched
    st = m.stats()["quotas"]
    assert st["limits"]["tenant-a"]["limit"] == 7 << 19
    assert st["limits"]["tenant-a"]["used"] <= 7 << 19
    assert st["refused"] >= 1
    from support.mount import scrape
    metrics = scrape(m)
    assert metrics[("kvfs_namespace_quota_bytes", ("tenant-a",))] == 7 << 19
    assert metrics[("kvfs_quota_evictions_total", ())] == st["evicted"]
    assert metrics[("kvfs_quota_refused_writes_total", ())] == st["refused"]
    ls = run_kvfs("quota", "ls", m.path)
    assert ls.returncode == 0 and "tenant-a" in ls.stdout and "3.5 MiB" in ls.stdout
    m.remount()                                               # kept in the index
    assert os.getxattr(ta, "user.kvfs.quota") == str(7 << 19).encode()
    assert run_kvfs("quota", "rm", m.path, "tenant-a").returncode == 0
    with pytest.raises(OSError) as e:
        os.getxattr(ta, "user.kvfs.quota")
    assert e.value.errno == errno.ENODATA


def test_quota_errors_are_one_line(kvfs_mount):
    m = kvfs_mount()
    (m.path / "ns" / "sub").mkdir(parents=True)
    for args, word in ((("ns/sub", "1MiB"), "top-level directory"), (("ns", "10%"), "percentage"),
                       (("missing", "1MiB"), "no such directory")):
        res = run_kvfs("quota", "set", m.path, *args)
        assert res.returncode != 0 and word in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr


def _settled(m) -> dict:
    from support.mount import wait_for
    return wait_for(lambda: (lambda s: s if s["settled"] else None)(m.stats()), 120, "the store to settle")


def _fill_in_turn(m, first: Path, first_files: dict, then: Path, then_files: dict) -> dict:
    """Write ``first_files`` into ``first`` and let the store settle, then ``then_files`` into
    ``then``; the stats once it has settled again."""
    for d, files in ((first, first_files), (then, then_files)):
        for name, data in files.items():
            put(d / name, data)
        st = _settled(m)
    return st


def test_eviction_under_pressure_is_fair_between_namespaces(kvfs_mount):
    """Two namespaces, no quotas: one writes three blocks, the other far more than the tiers
    hold. Under plain LRU the small one's blocks (the oldest) would go first; fair eviction
    takes them from the namespace holding the most of the full tier."""
    m = kvfs_mount(ram="4MiB", nvme_size="12MiB")
    small = {f"s{i}": content(f"small{i}", MB) for i in range(3)}
    big = {f"b{i:02d}": content(f"big{i}", MB) for i in range(30)}
    st = _fill_in_turn(m, m.path / "small", small, m.path / "big", big)
    assert st["tiers"]["nvme"]["evictions"] > 0                 # the tiers were full
    for name, data in small.items():
        assert read(m.path / "small" / name) == data, name   # the small namespace kept them all
    kept = sorted(p.name for p in (m.path / "big").iterdir())
    assert 0 < len(kept) < len(big)
    assert kept[-1] == "b29"                                  # the big one lost its own oldest first
    for name in kept:
        assert read(m.path / "big" / name) == big[name], name
    ns = m.stats()["namespaces"]
    assert ns["small"]["blocks"] == 3 and ns["big"]["blocks"] == len(kept)


def test_under_pressure_quotas_weigh_the_shares(kvfs_mount):
    """Shares follow quotas: a namespace with a small quota that fills it loses blocks before a
    namespace that holds more bytes but far less of its (larger) quota; with equal weights it
    would be the other way round (the test above)."""
    m = kvfs_mount(ram="4MiB", nvme_size="12MiB")
    for ns, size in (("big-quota", "64MiB"), ("small-quota", "8MiB")):
        (m.path / ns).mkdir()
        assert run_kvfs("quota", "set", m.path, ns, size).returncode == 0
    small = {f"s{i}": content(f"sq{i}", MB) for i in range(6)}
    big = {f"b{i:02d}": content(f"bq{i}", MB) for i in range(10)}
    st = _fill_in_turn(m, m.path / "small-quota", small, m.path / "big-quota", big)
    assert st["tiers"]["nvme"]["evictions"] > 0
    for name, data in big.items():                           # 10 MB of 64: under its share
        assert read(m.path / "big-quota" / name) == data, name
    kept = sorted(p.name for p in (m.path / "small-quota").iterdir())
    # it lost blocks, not all of them (its share is 8 of 72 MiB). Which ones is not promised:
    # LRU holds per tier, in the order blocks reached it, and a write that spills under RAM
    # pressure reaches NVMe before older blocks demoted from RAM later (failed 1 run in ~20
    # at load 11 when this asserted that the newest, s5, survives)
    assert 0 < len(kept) < len(small)
    for name in kept:
        assert read(m.path / "small-quota" / name) == small[name]
