"""mount/mount.kvfs: the mount(8) helper that turns fstab options into ``kvfs mount`` flags."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvfs.proc import pid_alive
from support.mount import REPO, lazy_unmount, run_kvfs

HELPER = REPO / "mount" / "mount.kvfs"


@pytest.fixture
def kvfs_bin(tmp_path):
    """An executable ``kvfs`` for this checkout, as /usr/local/bin/kvfs would be."""
    exe = tmp_path / "bin" / "kvfs"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m kvfs.cli \"$@\"\n")
    exe.chmod(0o755)
    return exe


def helper(*args, kvfs_bin=None):
    env = dict(os.environ)
    if kvfs_bin:
        env["KVFS_BIN"] = str(kvfs_bin)
    return subprocess.run([str(HELPER), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=180, stdin=subprocess.DEVNULL)


def test_fake_mount_translates_fstab_options(kvfs_bin):
    res = helper("kvfs", "/mnt/kvfs", "-f", "-o",
                 "rw,ram=8GiB,nvme=/nvme/kvfs,nvme_size=1TiB,defaults,noauto,_netdev,nofail,"
                 "user,x-systemd.automount,allow_other,volatile_ram,state=/var/lib/kvfs,metrics=0.0.0.0:9108",
                 kvfs_bin=kvfs_bin)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [
        str(kvfs_bin), "mount", "/mnt/kvfs", "--ram", "8GiB", "--nvme", "/nvme/kvfs",
        "--nvme-size", "1TiB", "--allow-other", "--volatile-ram", "--state", "/var/lib/kvfs",
        "--metrics", "0.0.0.0:9108"]


@pytest.mark.parametrize("opts,needle,code", [
    ("ram=8GiB,turbo", "unknown option: turbo", 1),
    ("ram=", "needs a value", 1),
    ("ro,ram=1GiB", "read-only", 1),
])
def test_bad_options(kvfs_bin, opts, needle, code):
    res = helper("kvfs", "/mnt/kvfs", "-o", opts, kvfs_bin=kvfs_bin)
    assert res.returncode == code
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_sloppy_ignores_unknown_options(kvfs_bin):
    res = helper("kvfs", "/mnt/kvfs", "-sf", "-o", "ram=1GiB,turbo", kvfs_bin=kvfs_bin)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-2:] == ["--ram", "1GiB"]


def test_missing_kvfs_command(tmp_path):
    res = helper("kvfs", tmp_path, "-o", "ram=1GiB", kvfs_bin=tmp_path / "no-such-kvfs")
    assert res.returncode == 32 and "kvfs command not found" in res.stderr


@pytest.mark.mount
def test_helper_mounts_for_real(tmp_path, kvfs_bin):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing on this machine")
    mp, nvme = tmp_path / "mnt", tmp_path / "nvme"
    mp.mkdir()
    res = helper("kvfs", mp, "-o", f"defaults,nofail,ram=32MiB,nvme={nvme},nvme_size=512MiB",
                 kvfs_bin=kvfs_bin)
    try:
        assert res.returncode == 0, res.stderr
        assert os.path.ismount(mp)
        st = json.loads((mp / ".kvfs" / "stats").read_bytes())
        assert st["tiers"]["ram"]["capacity"] == 32 << 20
        assert st["tiers"]["nvme"]["capacity"] == 512 << 20
        assert st["nvme_dir"] == str(nvme)
        # mounting again through the helper is a mount failure (32) with kvfs's message
        again = helper("kvfs", mp, "-o", f"nvme={nvme}", kvfs_bin=kvfs_bin)
        assert again.returncode == 32 and "already mounted" in again.stderr
        res = run_kvfs("umount", mp)
        assert res.returncode == 0, res.stderr
        assert not pid_alive(st["pid"])
    finally:
        if os.path.ismount(mp):
            lazy_unmount(mp)
