"""``kvfs umount`` of a mount whose daemon is dead (issue 40, item 7): it detaches the mount,
exits 0, says the daemon was dead and what the next mount will drop (the index's tally, read
offline), and leaves none of the dead daemon's RAM-tier tmpfs mounted."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
from pathlib import Path

import pytest

from kvfs.proc import mounts, pid_alive
from kvfs.store import hugefs
from support.files import MiB, content
from support.mount import EXIT_TIMEOUT, run_kvfs, wait_for

pytestmark = pytest.mark.mount


def ram_tmpfs(instance: str) -> list[str]:
    """The RAM-tier tmpfs mounts of ``instance`` in the mount table."""
    return [m.mountpoint for m in mounts() if m.fstype == "tmpfs"
            and os.path.basename(m.mountpoint).startswith(hugefs.tag(instance))]


def commit_index(path: Path) -> None:
    """Every change so far in the index on disk (fsync(2) commits the group; a kill -9 loses
    only what no commit took yet)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), EXIT_TIMEOUT, f"daemon {pid} to die")


def test_umount_of_a_dead_daemons_mount_detaches_and_says_what_the_next_mount_drops(kvfs_mount):
    m = kvfs_mount(ram="16MiB", nvme_size="256MiB")
    st = m.stats()
    pid, instance = int(st["pid"]), st["instance"]
    # one file spilled to NVMe (kept), one sealed only in RAM and one never sealed (dropped)
    (m.path / "durable").write_bytes(content("d", 24 * MiB))
    wait_for(lambda: os.getxattr(m.path / "durable", "user.kvfs.tier") == b"nvme", 60, "durable on NVMe")
    (m.path / "ramonly").write_bytes(content("r", 64 << 10))
    assert os.getxattr(m.path / "ramonly", "user.kvfs.tier") == b"ram"
    fd = os.open(m.path / "unsealed", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, content("u", 8192))
        commit_index(m.path / "ramonly")
        tmpfs = ram_tmpfs(instance)
        kill9(pid)
        # what a killed daemon leaves: a mount that answers ENOTCONN and its RAM tier's tmpfs
        with pytest.raises(OSError) as e:
            os.stat(m.path)
        # ENOTCONN, or ECONNABORTED when the kernel saw the connection aborted mid-request
        assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
        assert ram_tmpfs(instance) == tmpfs
        res = run_kvfs("umount", m.path)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    assert res.returncode == 0, res.stderr + res.stdout
    out = res.stdout
    assert f"daemon of {m.path} (pid {pid}) was dead: detached" in out, out
    assert "will drop 2 files: 1 never sealed, 1 whose only copy was in RAM" in out, out
    assert "/unsealed" in out and "/ramonly" in out and "durable" not in out, out
    assert not os.path.ismount(m.path)
    assert ram_tmpfs(instance) == [], "the dead daemon's RAM tmpfs is still mounted"
    # and the next mount drops exactly that
    m.pid = None
    m.mount()
    names = sorted(os.listdir(m.path))
    assert "durable" in names and "ramonly" not in names and "unsealed" not in names, names
    m.umount()


def test_umount_of_a_dead_daemon_whose_files_were_all_durable_says_nothing_is_dropped(kvfs_mount):
    m = kvfs_mount("--transport", "pyfuse3", ram="16MiB", nvme_size="256MiB")
    pid = int(m.stats()["pid"])
    (m.path / "durable").write_bytes(content("d", 24 * MiB))
    wait_for(lambda: os.getxattr(m.path / "durable", "user.kvfs.tier") == b"nvme", 60, "durable on NVMe")
    commit_index(m.path / "durable")
    kill9(pid)
    res = run_kvfs("umount", m.path)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "was dead: detached" in res.stdout and "the next mount drops nothing" in res.stdout, res.stdout
    assert not os.path.ismount(m.path)
    again = run_kvfs("umount", m.path)                  # nothing mounted any more
    assert again.returncode == 1 and "not mounted" in again.stderr


def test_lazy_umount_of_a_dead_daemon_reports_too(kvfs_mount):
    m = kvfs_mount(ram="16MiB", nvme_size="256MiB")
    st = m.stats()
    (m.path / "ramonly").write_bytes(b"x" * 5000)
    commit_index(m.path / "ramonly")
    kill9(int(st["pid"]))
    res = run_kvfs("umount", "--lazy", m.path)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "was dead: detached" in res.stdout and "1 whose only copy was in RAM" in res.stdout, res.stdout
    assert ram_tmpfs(st["instance"]) == []


def test_a_live_daemon_is_not_taken_for_dead(kvfs_mount):
    """A record whose daemon runs: umount is the ordinary one (flush, report, exit)."""
    m = kvfs_mount(ram="16MiB", nvme_size="256MiB")
    res = m.umount()
    assert "was dead" not in res.stdout and "unmounted" in res.stdout
    from kvfs import mountrecord
    assert mountrecord.read(str(m.path)) is None, "a clean exit leaves its mount record"
