"""``kvfs fsck`` through the CLI on the state a real mount left behind."""
from __future__ import annotations

import os

import pytest

from support.mount import wait_for, assert_one_line_error

pytestmark = pytest.mark.mount


def fill(m, n=12, size=4 << 20):
    for i in range(n):
        p = m.path / f"d{i % 3}" / f"{i:02d}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(bytes([i + 1]) * size)
    wait_for(lambda: any(os.getxattr(m.path / f"d{i % 3}" / f"{i:02d}.bin", "user.kvfs.tier")
                         == b"nvme" for i in range(n)), 120, "a file on nvme")


def nvme_objects(m):
    return sorted(p for p in (m.nvme / "objects").rglob("*") if p.is_file())


def test_fsck_clean_then_corrupt_then_repair(kvfs_mount, kvfs_cli):
    m = kvfs_mount(ram="32MiB")
    fill(m)
    m.umount()
    args = ("fsck", "--nvme", m.nvme, "--state", m.state)

    res = kvfs_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "clean" in res.stdout

    victim = nvme_objects(m)[0]
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    res = kvfs_cli(*args)
    assert res.returncode == 1
    assert "problem:" in res.stdout and "--repair" in res.stderr
    assert "Traceback" not in res.stderr

    res = kvfs_cli(*args, "--repair")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "repaired" in res.stdout
    res = kvfs_cli(*args)
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr


def test_fsck_refuses_a_mounted_state(kvfs_mount, kvfs_cli):
    m = kvfs_mount()
    res = kvfs_cli("fsck", "--nvme", m.nvme, "--state", m.state)
    assert_one_line_error(res, "in use")
    assert m.stats()["pid"] == m.pid


def test_a_planted_tree_in_grants_is_reported_and_removed_by_fsck_and_mount(kvfs_mount, kvfs_cli, tmp_path):
    """Issue 40, item 2: a 1,600-level tree, symlinks out and a fifo left in ``<nvme>/grants/``
    (what a tenant could put in its own grants directory) crash neither fsck nor mount."""
    from support.planted import DEPTH, plant
    m = kvfs_mount(ram="32MiB")
    (m.path / "d0").mkdir()
    (m.path / "d0" / "00.bin").write_bytes(bytes([1]) * (4 << 20))
    m.umount()
    args = ("fsck", "--nvme", m.nvme, "--state", m.state)
    outside = plant(m.nvme / "grants" / "1000", outside=tmp_path / "out")
    res = kvfs_cli(*args)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "RecursionError" not in res.stderr + res.stdout
    assert f"{DEPTH} directories" in res.stdout and "3 symlinks" in res.stdout and "1 fifo" in res.stdout
    assert "--repair" not in res.stderr          # already removed: nothing left to repair
    assert os.listdir(m.nvme / "grants") == []
    assert (outside / "precious").read_bytes() == b"keep me"
    res = kvfs_cli(*args)
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr

    plant(m.nvme / "grants" / "1000", outside=tmp_path / "out")
    res = kvfs_cli(*args, "--repair")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert os.listdir(m.nvme / "grants") == []

    plant(m.nvme / "grants" / "1000", outside=tmp_path / "out")
    m.mount()
    assert os.listdir(m.nvme / "grants") == []
    assert (m.path / "d0" / "00.bin").read_bytes() == bytes([1]) * (4 << 20)
    assert (outside / "precious").read_bytes() == b"keep me"
    m.umount()
    res = kvfs_cli(*args)
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr
