"""The kvfs command against real mounts: mount, stat, ls, umount, foreground, errors a daemon reports."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from kvfs.proc import pid_alive
from support.mount import _env, kvfs_command, lazy_unmount, run_kvfs, wait_for, assert_one_line_error

pytestmark = pytest.mark.mount

TIER_KEYS = ("capacity", "used", "objects", "hits", "misses", "bytes_read", "bytes_written",
             "demotions", "promotions", "evictions", "checksum_failures")


def write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def test_stat_json_and_table(kvfs_mount, kvfs_cli):
    m = kvfs_mount()
    st = m.stats()
    assert st["pid"] == m.pid and pid_alive(m.pid)
    assert os.path.realpath(st["mountpoint"]) == os.path.realpath(m.path)
    for tier in ("ram", "nvme"):
        for key in TIER_KEYS:
            assert isinstance(st["tiers"][tier][key], int), (tier, key)
    assert st["tiers"]["ram"]["capacity"] == 64 << 20
    assert st["tiers"]["nvme"]["capacity"] == 1 << 30

    res = kvfs_cli("stat", m.path, "--json")
    assert res.returncode == 0, res.stderr
    printed = json.loads(res.stdout)
    assert printed["pid"] == st["pid"] and printed["tiers"].keys() == st["tiers"].keys()

    write(m.path / "a.bin", b"x" * 100_000)
    res = kvfs_cli("stat", m.path)
    assert res.returncode == 0, res.stderr
    assert "ram" in res.stdout and "nvme" in res.stdout and str(m.pid) in res.stdout
    after = json.loads(kvfs_cli("stat", m.path, "--json").stdout)
    assert after["tiers"]["ram"]["bytes_written"] >= 100_000
    assert after["tiers"]["ram"]["objects"] >= 1


def test_umount_waits_for_the_daemon(kvfs_mount):
    m = kvfs_mount()
    pid = m.pid
    for i in range(5):
        write(m.path / f"d{i}" / "blk.bin", os.urandom(1 << 20))
    m.umount()   # asserts rc 0, not mounted, and the daemon gone when it returns
    assert not pid_alive(pid)
    m.mount()
    for i in range(5):
        assert (m.path / f"d{i}" / "blk.bin").stat().st_size == 1 << 20


def test_mount_with_no_options_uses_defaults(tmp_path):
    home, mp = tmp_path / "home", tmp_path / "mnt"
    home.mkdir()
    mp.mkdir()
    env = {"HOME": str(home)}
    res = run_kvfs("mount", mp, env=env)
    try:
        assert res.returncode == 0, res.stderr
        assert os.path.ismount(mp)
        st = json.loads(run_kvfs("stat", mp, "--json").stdout)
        assert st["nvme_dir"] == str(home / ".cache" / "kvfs" / "nvme")
        assert st["state_dir"] == str(home / ".cache" / "kvfs" / "nvme" / "state")
        ram_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert st["tiers"]["ram"]["capacity"] == int(ram_total * 10 / 100)
        res = run_kvfs("umount", mp)
        assert res.returncode == 0, res.stderr
        assert not pid_alive(st["pid"])
    finally:
        if os.path.ismount(mp):
            lazy_unmount(mp)


def test_config_file_with_flag_override(tmp_path, kvfs_mount):
    nvme = tmp_path / "from-config-nvme"
    cfg = tmp_path / "kvfs.toml"
    cfg.write_text(f'[kvfs]\nram = "32MiB"\nnvme = "{nvme}"\nnvme_size = "512MiB"\n')
    # the fixture passes --nvme itself; point it at the config's value so only ram differs
    m = kvfs_mount("--config", cfg, ram="48MiB", nvme_size=None, nvme=nvme)
    st = m.stats()
    assert st["tiers"]["ram"]["capacity"] == 48 << 20          # flag wins
    assert st["tiers"]["nvme"]["capacity"] == 512 << 20        # from the file
    assert st["nvme_dir"] == str(nvme)


def test_already_mounted_by_kvfs(kvfs_mount, kvfs_cli):
    m = kvfs_mount()
    res = kvfs_cli("mount", m.path, "--nvme", m.nvme, "--state", m.state)
    assert_one_line_error(res, "already mounted")
    assert m.stats()["pid"] == m.pid


def test_state_dir_in_use_by_another_mount(tmp_path, kvfs_mount, kvfs_cli):
    m = kvfs_mount()
    other = tmp_path / "other"
    other.mkdir()
    res = kvfs_cli("mount", other, "--nvme", tmp_path / "nvme2", "--state", m.state,
                   "--ram", "16MiB", "--nvme-size", "256MiB")
    try:
        assert_one_line_error(res, "in use")
        assert not os.path.ismount(other)
    finally:
        if os.path.ismount(other):
            lazy_unmount(other)
    assert m.stats()["pid"] == m.pid


def test_ls_reports_tier_hits_atime_pin(kvfs_mount, kvfs_cli):
    m = kvfs_mount()
    write(m.path / "a.bin", b"a" * 5000)
    write(m.path / "sub" / "b.bin", b"b" * 7000)
    os.setxattr(m.path / "a.bin", "user.kvfs.pin", b"1")
    before = float(os.getxattr(m.path / "a.bin", "user.kvfs.atime"))   # the daemon's clock, at the seal
    for _ in range(3):
        with open(m.path / "a.bin", "rb") as f:
            assert f.read() == b"a" * 5000

    res = kvfs_cli("ls", m.path, "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert set(rows) == {"a.bin", "sub"}
    a = rows["a.bin"]
    assert (a["type"], a["size"], a["tier"], a["pinned"]) == ("file", 5000, "ram", True)
    assert isinstance(a["hits"], int) and a["hits"] >= 1
    assert a["atime"] is not None and a["atime"] >= before      # the opens moved it on (no wall clock here)
    assert rows["sub"]["type"] == "dir"

    res = kvfs_cli("ls", m.path / "sub" / "b.bin", "--json")
    (b,) = json.loads(res.stdout)
    assert (b["name"], b["size"], b["tier"], b["pinned"]) == ("b.bin", 7000, "ram", False)

    res = kvfs_cli("ls", m.path)
    assert res.returncode == 0, res.stderr
    assert "a.bin" in res.stdout and "sub/" in res.stdout and "ram" in res.stdout


def test_ls_shows_demoted_files_on_nvme(kvfs_mount, kvfs_cli):
    m = kvfs_mount()   # 64 MiB of RAM; 40 x 4 MiB must push some down
    for i in range(40):
        write(m.path / f"g{i % 4}" / f"{i:02d}.bin", bytes([i]) * (4 << 20))

    def tiers():
        out = []
        for g in range(4):
            res = kvfs_cli("ls", m.path / f"g{g}", "--json")
            assert res.returncode == 0, res.stderr
            out += [r["tier"] for r in json.loads(res.stdout)]
        return out

    seen = wait_for(lambda: (t := tiers()).count("nvme") and t, 120, "some files on nvme")
    assert len(seen) == 40 and set(seen) <= {"ram", "nvme"}
    # some were demoted (others may have been streamed to NVMe directly when RAM was full)
    res = kvfs_cli("stat", m.path, "--json")
    assert json.loads(res.stdout)["tiers"]["ram"]["demotions"] >= 1


def test_umount_busy_fails_then_succeeds(kvfs_mount, kvfs_cli):
    m = kvfs_mount()
    write(m.path / "busy.bin", b"z" * 4096)
    f = open(m.path / "busy.bin", "rb")
    try:
        res = kvfs_cli("umount", m.path)
        assert_one_line_error(res, "cannot unmount")
        assert os.path.ismount(m.path) and pid_alive(m.pid)
    finally:
        f.close()
    m.umount()


def test_umount_of_a_dead_daemon_detaches_it(kvfs_mount, kvfs_cli):
    """Issue 40 item 7 (it once asked for --lazy): tests/cli/test_umount_dead.py has the rest."""
    m = kvfs_mount()
    os.kill(m.pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(m.pid), 60, "the daemon to die")
    res = kvfs_cli("umount", m.path)
    assert res.returncode == 0, res.stderr
    assert "was dead: detached" in res.stdout
    assert not os.path.ismount(m.path)


def test_foreground_mount_stays_attached(tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.Popen(
        [*kvfs_command(), "mount", str(mp), "--foreground", "--ram", "16MiB",
         "--nvme", str(tmp_path / "nvme"), "--nvme-size", "256MiB"],
        env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: os.path.ismount(mp) or proc.poll() is not None, 120, "the mount")
        assert proc.poll() is None, proc.stderr.read().decode()
        with open(mp / ".kvfs" / "stats", "rb") as f:
            assert json.loads(f.read())["pid"] == proc.pid   # the daemon is the CLI process
        write(mp / "x.bin", b"fg" * 1000)
        subprocess.run(["fusermount3", "-u", str(mp)], check=True)
        assert proc.wait(timeout=120) == 0
    finally:
        if os.path.ismount(mp):
            lazy_unmount(mp)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_umount_lazy_when_the_dead_mount_answers_enotconn(kvfs_mount, kvfs_cli):
    """Issue 11 item 9: once the dead daemon's mount answers stat() with ENOTCONN (its root's
    cached attributes gone), ``os.path.ismount`` says False; ``kvfs umount --lazy`` must find
    the mount in the kernel's mount table and detach it (and so must a plain ``kvfs umount``
    since issue 40 item 7). Creating a file in the root just
    before the kill invalidates the root's cached attributes, so the next stat() goes to the
    dead daemon at once (no waiting for the attribute timeout)."""
    m = kvfs_mount()
    pid = m.pid
    (m.path / "touch.bin").write_bytes(b"x")     # the root directory changed: attrs invalid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 60, "the daemon to die")
    with pytest.raises(OSError) as err:
        os.stat(m.path)
    # ENOTCONN, or ECONNABORTED when the kernel saw the connection aborted mid-request
    assert err.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    assert not os.path.ismount(m.path)            # what the old check relied on
    res = kvfs_cli("umount", m.path)              # not lazy either: the daemon is dead
    assert res.returncode == 0, res.stderr
    assert "was dead: detached" in res.stdout
    with open("/proc/self/mountinfo") as f:
        assert f" {m.path} " not in f.read()
    assert os.path.isdir(m.path) and not os.path.ismount(m.path)
    m.pid = None


def test_ls_recursive_on_a_2100_deep_tree(kvfs_mount, kvfs_cli):
    """Issue 11 item 12: ``kvfs ls -R`` walks a tree deeper than Python's recursion limit (1000)
    and than PATH_MAX (2100 levels of ``d``: a 4200-character path)."""
    m = kvfs_mount()
    depth = 2100
    assert depth > sys.getrecursionlimit() and 2 * depth > os.pathconf("/", "PC_PATH_MAX")
    fd = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):                    # relative to the parent's fd: no PATH_MAX
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        wfd = os.open("leaf.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(wfd, b"L" * 1234)
        os.close(wfd)
    finally:
        os.close(fd)
    (m.path / "z.bin").write_bytes(b"z" * 10)     # listed after the whole d/ subtree
    res = kvfs_cli("ls", "-R", "--json", m.path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    assert len(rows) == depth + 2
    deep = "/".join(["d"] * depth)
    assert [r["name"] for r in rows[:3]] == ["d", "d/d", "d/d/d"]
    assert rows[depth - 1]["name"] == deep and rows[depth - 1]["type"] == "dir"
    leaf = rows[depth]
    assert (leaf["name"], leaf["type"], leaf["size"], leaf["tier"]) == (deep + "/leaf.bin", "file", 1234, "ram")
    assert leaf["path"] == str(m.path / deep / "leaf.bin")
    assert (rows[-1]["name"], rows[-1]["size"]) == ("z.bin", 10)
    res = kvfs_cli("ls", "-R", m.path)            # the table too
    assert res.returncode == 0, res.stderr[-2000:]
    assert "leaf.bin" in res.stdout
