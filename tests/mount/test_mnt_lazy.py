"""``kvfs umount --lazy`` of a mount whose daemon is stuck (SIGSTOPped: every request to it
waits): the command must not wait on the mount before it detaches it."""
from __future__ import annotations

import os
import signal

import pytest

from kvfs.proc import pid_alive
from support.mount import open_mount, run_kvfs

pytestmark = pytest.mark.mount


def in_mount_table(path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return f" {path} " in f.read()


def test_lazy_umount_of_a_stopped_daemon_detaches_without_waiting_on_it(tmp_path):
    m = open_mount(tmp_path / "kvfs", ram="16MiB", nvme_size="256MiB")
    pid = m.pid
    (m.path / "x.bin").write_bytes(b"x" * 4096)
    os.kill(pid, signal.SIGSTOP)
    try:
        # before the fix this read .kvfs/stats through the mount first, and hung there
        res = run_kvfs("umount", "--lazy", m.path, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "unmounted" in res.stdout
        assert not in_mount_table(m.path)
    finally:
        os.kill(pid, signal.SIGCONT)
        m.cleanup()


def test_lazy_umount_of_a_live_daemon_still_waits_for_its_exit(tmp_path):
    m = open_mount(tmp_path / "kvfs", ram="16MiB", nvme_size="256MiB")
    try:
        (m.path / "x.bin").write_bytes(b"x" * 4096)
        res = run_kvfs("umount", "--lazy", m.path, timeout=120)
        assert res.returncode == 0, res.stderr
        assert not in_mount_table(m.path)
        assert not pid_alive(m.pid)                      # it waited for the daemon's exit
        m.mount()
        assert (m.path / "x.bin").read_bytes() == b"x" * 4096
        m.umount()
    finally:
        m.cleanup()
