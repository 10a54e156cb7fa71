"""A failing NVMe filesystem under a real mount: demotions whose writes fail (EPERM from
immutable shard directories on the ext4 under the test; EIO and EROFS take the same path)
are counted in the tier's ``errors``, the objects stay in RAM and read back right, the
daemon lives on, and demotion resumes once the directory takes writes again."""
from __future__ import annotations

import contextlib
import subprocess

import pytest

from kvfs.proc import pid_alive
from support.files import content, read
from support.mount import open_mount, wait_for

pytestmark = pytest.mark.mount

KiB = 1 << 10


def chattr(flag: str, dirs) -> None:
    subprocess.run(["chattr", flag, *map(str, dirs)], check=True, capture_output=True)


def settled(m) -> dict:
    return wait_for(lambda: (lambda s: s if s["settled"] else None)(m.stats()), 120, "the store to settle")


def test_failed_nvme_writes_keep_objects_in_ram_and_the_daemon_alive(tmp_path):
    m = open_mount(tmp_path / "kvfs", ram="8MiB", nvme_size="256MiB")
    shards = sorted((m.nvme / "objects").iterdir())
    assert len(shards) == 256
    want = {}
    try:
        chattr("+i", shards)                 # creating an object file there: EPERM
        d = m.path / "d"
        d.mkdir()
        for i in range(30):                  # 7.5 MiB of 8: above the high watermark
            want[i] = content(f"f{i}", 256 * KiB)
            (d / f"f{i}").write_bytes(want[i])
        st = settled(m)
        assert pid_alive(m.pid)
        assert st["tiers"]["nvme"]["errors"] >= 1 and st["tiers"]["nvme"]["objects"] == 0
        assert st["tiers"]["ram"]["objects"] == len(want)
        for i, data in want.items():
            assert read(d / f"f{i}") == data
        assert "writing object" in m.log_tail(400)
        chattr("-i", shards)
        want[30] = content("f30", 256 * KiB)
        (d / "f30").write_bytes(want[30])    # a new write kicks the pressure loop again
        st = settled(m)
        assert st["tiers"]["nvme"]["objects"] > 0 and st["tiers"]["ram"]["demotions"] > 0
        for i, data in want.items():
            assert read(d / f"f{i}") == data
        m.remount()
        for i, data in want.items():
            assert read(d / f"f{i}") == data
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            chattr("-i", shards)
        m.cleanup()
