"""The kernel transport's busy-poll after a request (config ``fuse_spin_us``, kvfs/fs/loop.py
``Reader.spin``; docs/benchmarks.md "The open's round trip"): a mount with it on reads and
writes right (the spin hands requests to the same handlers, also while another worker's
handler waits), and a value that is not a window of microseconds is refused at mount with one
line naming the key, from the config file and from ``KVFS_FUSE_SPIN_US``."""
from __future__ import annotations

import mmap
import os

import pytest

from support.files import content, read
from support.mount import run_kvfs

pytestmark = pytest.mark.mount


def test_a_mount_that_spins_reads_and_writes_right(kvfs_mount, tmp_path):
    cfg = tmp_path / "spin.toml"
    cfg.write_text("[kvfs]\nfuse_spin_us = 200\npassthrough = true\n")
    m = kvfs_mount("--config", cfg)
    if m.stats()["transport"]["name"] != "kernel":
        pytest.skip("the spin is kvfs's own transport's")
    d = m.path / "spin"
    d.mkdir()
    sizes = [0, 1, 4095, 32 << 10, (2 << 20) + 7]
    for round_ in range(3):                  # written, read at once, rewritten, read again
        for i, size in enumerate(sizes):
            p = d / f"f{i}"
            data = content(f"f{i}-{round_}", size)
            p.write_bytes(data)
            assert read(p) == data
            if size:
                with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                    assert mm[:] == data
    os.rename(d / "f0", d / "g0")
    assert sorted(os.listdir(d)) == ["f1", "f2", "f3", "f4", "g0"]
    for i, size in enumerate(sizes[1:], start=1):
        assert read(d / f"f{i}") == content(f"f{i}-2", size)
    loop_stats = m.stats()["request_loop"]
    assert loop_stats["spin_us"] == 200 and loop_stats["spins"] > 0
    # every window ended with a request or without one (a window still open at the stats
    # read, paused at a checkpoint, is counted in spins only)
    assert loop_stats["read_spinning"] + loop_stats["spin_missed"] <= loop_stats["spins"]


@pytest.mark.parametrize("value", ["-1", "10001", '"fast"', "true", "1.5"])
def test_a_bad_spin_window_is_refused_with_one_line(tmp_path, value):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f"[kvfs]\nfuse_spin_us = {value}\n")
    mp = tmp_path / "mnt"
    mp.mkdir()
    r = run_kvfs("mount", mp, "--config", cfg, "--nvme", tmp_path / "nvme", "--state", tmp_path / "state")
    assert r.returncode != 0 and not os.path.ismount(mp)
    assert "fuse_spin_us must be a whole number of microseconds from 0 to 10000" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_bad_spin_window_from_the_environment_is_refused(tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    r = run_kvfs("mount", mp, "--nvme", tmp_path / "nvme", "--state", tmp_path / "state",
                 env={"KVFS_FUSE_SPIN_US": "lots"})
    assert r.returncode != 0 and not os.path.ismount(mp)
    assert "fuse_spin_us" in r.stderr and "'lots'" in r.stderr and "Traceback" not in r.stderr
