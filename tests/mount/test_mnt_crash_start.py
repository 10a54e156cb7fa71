"""The start after kill -9 reads the unsealed and RAM-only sets and the running totals kept in
the index's group commits (kvfs.store.tally), not every record: the right files are gone,
the tier totals, namespace totals and quota usage equal a full recount, and the records it
decoded (``recovered.decoded`` in ``.kvfs/stats``) are those of the two sets."""
from __future__ import annotations

import contextlib
import os

import pytest

from kvfs.errors import InUse
from kvfs.store import tally
from kvfs.store.index import Index
from support.files import content, read
from support.mount import run_kvfs, wait_for

pytestmark = pytest.mark.mount

KiB = 1 << 10


def _open_index(state):
    """The index, once the killed daemon's last thread has let go of its lock (the process
    counts as gone when its main thread is a zombie; the lock goes with the last thread)."""
    def attempt():
        try:
            return Index(state)
        except InUse:
            return None
    return wait_for(attempt, 60, "the killed daemon's state lock")


def _totals(m) -> dict:
    st = m.stats()
    return {"nvme": [st["tiers"]["nvme"]["used"], st["tiers"]["nvme"]["objects"]], "objects": st["objects"],
            "namespaces": {k: [v["bytes"], v["blocks"]] for k, v in st["namespaces"].items() if v["blocks"]},
            "quota": st["quotas"]["limits"].get("tenant", {}).get("used")}


def test_kill9_start_drops_the_sets_only_and_totals_and_quota_usage_are_exact(kvfs_mount):
    m = kvfs_mount(ram="4MiB", nvme_size="256MiB")
    tenant, other = m.path / "tenant", m.path / "other"
    tenant.mkdir()
    other.mkdir()
    res = run_kvfs("quota", "set", m.path, "tenant", "64MiB")
    assert res.returncode == 0, res.stderr
    data = {}
    for i in range(120):                    # more than RAM holds: the older ones go to NVMe
        for d in (tenant, other):
            p = d / f"f{i:03d}"
            data[p] = content(str(p), 96 * KiB + i)
            with open(p, "wb") as f:
                f.write(data[p])
    wait_for(lambda: m.stats()["settled"], 120, "pressure to settle")
    fds = []
    try:
        fd = os.open(tenant / "writing", os.O_WRONLY | os.O_CREAT, 0o644)    # quota in flight
        fds.append(fd)
        os.write(fd, content("w", 300 * KiB))
        fds.append(os.open(other / "empty-open", os.O_WRONLY | os.O_CREAT, 0o644))
        # the write's pressure demotes RAM objects: the RAM-only set is the one once that has
        # settled (read before it, a demotion landing before the kill kept a file "on RAM")
        wait_for(lambda: m.stats()["settled"], 120, "the write's pressure to settle")
        tier = {p: os.getxattr(p, "user.kvfs.tier").decode() for p in data}
        on_ram = {p for p, t in tier.items() if t == "ram"}
        assert on_ram and len(on_ram) < len(data) // 4
        assert m.stats()["quotas"]["limits"]["tenant"]["used"] > 0    # commits the index too
        m.kill9()
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    m.mount()
    got = m.stats()["recovered"]
    assert "clean" not in got and got["lost_objects"] == len(on_ram)
    assert got["dropped_files"] == len(on_ram) + 2
    decoded = got["decoded"]
    assert decoded <= 3 * (got["dropped_files"] + got["lost_objects"])     # the sets' records
    fast = _totals(m)
    for p, want in data.items():
        if p in on_ram:
            assert not p.exists(), f"{p} had its only copy in RAM"
        else:
            assert read(p) == want
    assert not (tenant / "writing").exists() and not (other / "empty-open").exists()
    m.kill9()
    ix = _open_index(m.state)               # the totals forgotten: the next start recounts
    tally.invalidate(ix)
    ix.close()
    m.mount()
    got = m.stats()["recovered"]
    assert got["decoded"] >= 2 * (len(data) - len(on_ram)) > decoded and not got["dropped_files"]
    assert _totals(m) == fast


def test_an_orphan_swept_at_start_leaves_the_nvme_totals_exact(kvfs_mount):
    """A file on the NVMe tier that no record names (a put cut off by kill -9: the bytes
    written, the record not committed) is deleted by the start's sweep without being taken
    off the tier's totals, which never counted it: they still equal a full recount."""
    m = kvfs_mount(ram="1MiB", nvme_size="64MiB")
    d = m.path / "d"
    d.mkdir()
    data = {d / f"f{i:02d}": content(f"f{i}", 96 * KiB + i) for i in range(24)}
    for p, b in data.items():
        with open(p, "wb") as f:
            f.write(b)
    wait_for(lambda: m.stats()["settled"], 120, "pressure to settle")
    assert m.umount().returncode == 0       # every file on NVMe (the write-down)
    src = next(p for p in (m.nvme / "objects").rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
    orphan = src.with_name("7fffffff" + src.name[8:])   # same shard, an id no record has
    orphan.write_bytes(src.read_bytes())
    m.mount()
    wait_for(lambda: not orphan.exists(), 60, "the start's sweep to delete the orphan")
    fast = _totals(m)
    for p, want in data.items():
        assert read(p) == want
    m.kill9()
    ix = _open_index(m.state)               # the totals forgotten: the next start recounts
    tally.invalidate(ix)
    ix.close()
    m.mount()
    assert _totals(m) == fast
