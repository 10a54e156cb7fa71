"""The kvfs command's bad-input handling: every error is one line on stderr with a non-zero exit.

These need no daemon: the CLI refuses before it spawns one.  The errors that only a running
daemon can report (state directory in use, already mounted by kvfs) are in test_mount_cli.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support.mount import REPO, assert_one_line_error, run_kvfs


@pytest.fixture
def mp(tmp_path) -> Path:
    d = tmp_path / "mnt"
    d.mkdir()
    return d


def mount_args(tmp_path, mp, *extra):
    return ["mount", mp, "--nvme", tmp_path / "nvme", "--state", tmp_path / "state", *extra]


def test_mountpoint_missing(tmp_path):
    res = run_kvfs(*mount_args(tmp_path, tmp_path / "nope"))
    assert_one_line_error(res, "does not exist", str(tmp_path / "nope"))
    assert not (tmp_path / "nvme").exists(), "nothing is created when the mountpoint is bad"


def test_mountpoint_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line_error(run_kvfs(*mount_args(tmp_path, f)), "not a directory")


def test_mountpoint_already_mounted(tmp_path):
    # /dev/shm is a real mountpoint on Linux; kvfs must refuse to mount over it
    assert os.path.ismount("/dev/shm")
    assert_one_line_error(run_kvfs(*mount_args(tmp_path, "/dev/shm")), "already mounted")


@pytest.mark.parametrize("flag,value", [
    ("--ram", "12XB"), ("--ram", "lots"), ("--ram", "150%"), ("--ram", "-5MiB"),
    ("--nvme-size", "1.5.5GiB"), ("--nvme-size", "0%"), ("--remote-size", "big"),
])
def test_unparsable_sizes(tmp_path, mp, flag, value):
    extra = [flag, value] + (["--remote", "nvme-tcp://127.0.0.1:4420/nqn.x"]
                             if flag == "--remote-size" else [])
    err = assert_one_line_error(run_kvfs(*mount_args(tmp_path, mp, *extra)))
    assert value in err or "percentage" in err or "size" in err


def test_nvme_dir_not_creatable(tmp_path, mp):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    res = run_kvfs("mount", mp, "--nvme", blocker / "nvme", "--state", tmp_path / "state")
    assert_one_line_error(res, "nvme directory", str(blocker / "nvme"))


def test_nvme_dir_is_a_file(tmp_path, mp):
    f = tmp_path / "nvmefile"
    f.write_text("x")
    res = run_kvfs("mount", mp, "--nvme", f, "--state", tmp_path / "state")
    assert_one_line_error(res, "nvme directory", "not a directory")


def test_nvme_dir_not_writable(tmp_path, mp):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        # root ignores permission bits: use a real read-only filesystem instead
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    else:
        ro.chmod(0o500)
    try:
        res = run_kvfs("mount", mp, "--nvme", ro, "--state", tmp_path / "state")
        assert_one_line_error(res, "not writable", str(ro))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=True)
        else:
            ro.chmod(0o700)


def test_state_dir_not_creatable(tmp_path, mp):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    res = run_kvfs("mount", mp, "--nvme", tmp_path / "nvme", "--state", blocker / "state")
    assert_one_line_error(res, "state directory")


def test_dirs_inside_mountpoint_refused(tmp_path, mp):
    res = run_kvfs("mount", mp, "--nvme", mp / "nvme", "--state", tmp_path / "state")
    assert_one_line_error(res, "outside the mountpoint")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="hiding /dev/fuse needs a private mount namespace (root + unshare)")
def test_dev_fuse_missing(tmp_path, mp):
    # In a private mount namespace, a fresh /dev without fuse: the machine really lacks it.
    script = ("mount -t tmpfs none /dev && "
              f"exec {' '.join(map(str, _kvfs_argv()))} mount {mp} "
              f"--nvme {tmp_path / 'nvme'} --state {tmp_path / 'state'}")
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert_one_line_error(res, "/dev/fuse")


def _kvfs_argv():
    from support.mount import kvfs_command
    return kvfs_command()


def test_config_file_missing(tmp_path, mp):
    res = run_kvfs(*mount_args(tmp_path, mp, "--config", tmp_path / "none.toml"))
    assert_one_line_error(res, "config file not found")


def test_config_file_invalid_toml(tmp_path, mp):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[kvfs]\nram = = 3\n")
    assert_one_line_error(run_kvfs(*mount_args(tmp_path, mp, "--config", cfg)), "not valid TOML")


def test_config_file_unknown_key(tmp_path, mp):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[kvfs]\nram = "64MiB"\nturbo = true\n')
    assert_one_line_error(run_kvfs(*mount_args(tmp_path, mp, "--config", cfg)), "unknown key",
                          "turbo")


def test_config_file_bad_size(tmp_path, mp):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[kvfs]\nnvme_size = "a lot"\n')
    assert_one_line_error(run_kvfs(*mount_args(tmp_path, mp, "--config", cfg)), "a lot")


def test_config_bad_watermarks(tmp_path, mp):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[kvfs]\nhigh_watermark = 0.5\nlow_watermark = 0.8\n")
    assert_one_line_error(run_kvfs(*mount_args(tmp_path, mp, "--config", cfg)), "watermark")


def test_umount_not_mounted(mp):
    assert_one_line_error(run_kvfs("umount", mp), "not mounted")


def test_umount_missing_dir(tmp_path):
    assert_one_line_error(run_kvfs("umount", tmp_path / "nope"), "no such directory")


def test_stat_not_a_mountpoint(mp):
    assert_one_line_error(run_kvfs("stat", mp), "not a mountpoint")


def test_stat_not_a_kvfs_mount():
    assert_one_line_error(run_kvfs("stat", "/dev/shm"), "not a kvfs mount")


def test_ls_missing_path(tmp_path):
    assert_one_line_error(run_kvfs("ls", tmp_path / "nope"), "no such file")


def test_ls_tree_missing_namespace(tmp_path):
    assert_one_line_error(run_kvfs("ls", "--tree", tmp_path / "nope"), "namespace")


def test_fsck_no_state(tmp_path):
    res = run_kvfs("fsck", "--nvme", tmp_path / "nvme", "--state", tmp_path / "nostate")
    assert_one_line_error(res, "no kvfs state directory")


@pytest.mark.parametrize("args,needle", [
    (["bench", "--size", "huge"], "huge"),
    (["bench", "--size", "1MiB", "--block", "3000"], "multiple of 4096"),
    (["bench", "--only", "warp"], "warp"),
    (["bench", "--tmpfs", "/nonexistent-kvfs"], "tmpfs"),
])
def test_bench_bad_options(args, needle):
    assert_one_line_error(run_kvfs(*args), needle)


def test_unknown_command_and_option(mp):
    assert_one_line_error(run_kvfs("frobnicate"), "no such command", code=2)
    assert_one_line_error(run_kvfs("mount", mp, "--turbo"), "no such option", code=2)
    assert_one_line_error(run_kvfs("mount"), "missing argument", code=2)


def test_help_lists_every_command():
    res = run_kvfs("--help")
    assert res.returncode == 0
    for cmd in ("mount", "umount", "stat", "ls", "fsck", "bench"):
        assert cmd in res.stdout
    res = run_kvfs("mount", "--help")
    for opt in ("--ram", "--nvme", "--nvme-size", "--state", "--config", "--allow-other",
                "--foreground", "--remote", "--remote-size", "--format-remote",
                "--volatile-ram", "--debug"):
        assert opt in res.stdout, opt


def test_config_shm_dir_must_be_tmpfs(tmp_path, mp):
    from kvfs.proc import filesystem_of
    disk = tmp_path if filesystem_of(tmp_path)[1] != "tmpfs" else REPO     # a directory not in memory
    cfg = tmp_path / "disk.toml"
    cfg.write_text(f'[kvfs]\nshm_dir = "{disk}"\n')
    assert_one_line_error(run_kvfs(*mount_args(tmp_path, mp, "--config", cfg)), "not tmpfs", str(disk))
    cfg.write_text(f'[kvfs]\nshm_dir = "{tmp_path / "nope"}"\n')
    assert_one_line_error(run_kvfs(*mount_args(tmp_path, mp, "--config", cfg)), "not an existing directory")
    assert not (tmp_path / "nope").exists()
