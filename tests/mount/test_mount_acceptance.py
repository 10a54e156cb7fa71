"""Issue 2 acceptance through a real mount: demotion with temp-then-rename and persistence,
kill -9 during writes then remount, a flipped byte on NVMe gives EIO."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys

import pytest

from support.mount import wait_for

pytestmark = pytest.mark.mount

MiB = 1 << 20


def blob(seed: str, size: int) -> bytes:
    h = hashlib.sha256(seed.encode()).digest()
    return (h * (size // len(h) + 1))[:size]


def settled(m) -> bool:
    """No demotion, eviction or promotion running or queued, RAM at or under its high watermark."""
    st = m.stats()
    return st["settled"] and st["tiers"]["ram"]["used"] <= 0.9 * st["tiers"]["ram"]["capacity"]


def test_forty_files_demote_and_survive_remount(kvfs_mount):
    m = kvfs_mount(ram="64MiB", nvme_size="1GiB")
    root = m.path
    want = {}
    for i in range(40):
        d = root / f"ns{i % 4}" / f"{i % 7:02x}"
        d.mkdir(parents=True, exist_ok=True)
        final = d / f"block{i}.bin"
        tmp = d / f"block{i}.bin.tmp"
        data = blob(f"f{i}", 4 * MiB)
        tmp.write_bytes(data)
        os.replace(tmp, final)
        want[final] = data
    # demotion runs in the background: wait until it has brought RAM under its high watermark
    # (160 MiB went through a 64 MiB RAM tier, so RAM crossed it and demotion had to run)
    wait_for(lambda: settled(m), 120, "background demotion to settle")
    tiers = {os.getxattr(p, "user.kvfs.tier").decode() for p in want}
    assert "nvme" in tiers
    assert m.stats()["tiers"]["ram"]["demotions"] > 0
    for p, data in want.items():
        assert p.read_bytes() == data
    m.remount()
    for p, data in want.items():
        assert p.read_bytes() == data, p


WRITER = r"""
import os, sys, hashlib
root = sys.argv[1]
def blob(seed, size):
    h = hashlib.sha256(seed.encode()).digest()
    return (h * (size // len(h) + 1))[:size]
v = 0
while True:
    v += 1
    for i in range(6):
        name = os.path.join(root, f"f{i}")
        data = blob(f"{i}:{v}", 65536 + 4096 * (v % 7))
        if i % 2:
            tmp = name + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, name)
        else:
            with open(name, "wb") as f:
                f.write(data[:1000]); f.write(data[1000:])
        print(f"{i} {v}", flush=True)
"""


def _check_versions(root, closed: dict[int, int]) -> None:
    for i in range(6):
        p = root / f"f{i}"
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            continue
        # the content of some version that was fully written, never a mix
        v_hi = closed.get(i, 0) + 1
        ok = any(data == blob(f"{i}:{v}", 65536 + 4096 * (v % 7)) for v in range(1, v_hi + 1))
        assert ok, f"f{i} holds bytes of no written version (closed up to {closed.get(i)})"


@pytest.mark.parametrize("cycles", [pytest.param(20, id="20"),
                                    pytest.param(100, id="100", marks=pytest.mark.slow)])
def test_kill9_during_writes_then_remount(kvfs_mount, cycles):
    m = kvfs_mount(ram="8MiB", nvme_size="256MiB")
    for cycle in range(cycles):
        w = subprocess.Popen([sys.executable, "-c", WRITER, str(m.path)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        closed: dict[int, int] = {}
        for _ in range(5 + cycle % 9):           # let a few versions land, then kill mid-stream
            line = w.stdout.readline()
            if not line:
                break
            i, v = map(int, line.split())
            closed[i] = v
        m.kill9()
        w.kill()
        w.wait()
        m.mount()
        _check_versions(m.path, closed)
        assert not (m.path / ".kvfs" / "stats").read_text() == ""


def test_flipped_byte_on_nvme_gives_eio(kvfs_mount):
    m = kvfs_mount(ram="16MiB", nvme_size="512MiB")
    victim = m.path / "victim"
    victim.write_bytes(blob("victim", 6 * MiB))
    for i in range(8):                            # push it out of RAM
        (m.path / f"fill{i}").write_bytes(blob(f"fill{i}", 4 * MiB))
    # pushed out by background demotion (the oldest, coldest file): wait for it, not for time
    wait_for(lambda: os.getxattr(victim, "user.kvfs.tier") == b"nvme", 120, "the victim to reach NVMe")
    fd = os.open(victim, os.O_RDONLY)
    backing = json.loads(os.getxattr(fd, "user.kvfs.backing"))
    os.close(fd)
    assert backing["tier"] == "nvme"
    m.umount()
    with open(backing["path"], "r+b") as f:       # one flipped bit in the middle
        f.seek(3 * MiB + 17)
        b = f.read(1)
        f.seek(3 * MiB + 17)
        f.write(bytes([b[0] ^ 0x10]))
    m.mount()
    with pytest.raises(OSError) as ei:
        with open(victim, "rb") as f:
            while f.read(MiB):
                pass
    assert ei.value.errno == errno.EIO
    assert m.stats()["tiers"]["nvme"]["checksum_failures"] >= 1
    assert not victim.exists()
    for i in range(8):
        assert (m.path / f"fill{i}").read_bytes() == blob(f"fill{i}", 4 * MiB)
