"""``kvfs umount`` checks the daemon's unmount report only where the daemon announces that it
writes one: a daemon from before the report (an in-place upgrade of the CLI under a running
mount) unmounts cleanly with exit 0, not with a spurious "exited without reporting"."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfs.cli.mounting import report_dir
from kvfs.protocol import UNMOUNT_REPORT, UNMOUNT_REPORT_KEY


def test_a_daemon_without_the_announcement_is_not_checked():
    old = {"pid": 123, "mountpoint": "/mnt/kvfs", "state_dir": "/var/lib/kvfs"}   # before the report
    assert report_dir(old) is None
    assert report_dir({**old, UNMOUNT_REPORT_KEY: 1}) == Path("/var/lib/kvfs")
    assert report_dir({"pid": 123, UNMOUNT_REPORT_KEY: 1}) is None


@pytest.mark.mount
def test_the_daemon_announces_its_report_and_umount_checks_it(kvfs_mount):
    m = kvfs_mount(ram="8MiB")
    st = m.stats()
    assert st[UNMOUNT_REPORT_KEY] == 1 and report_dir(st) == Path(st["state_dir"])
    (m.path / "f").write_bytes(b"x" * 5000)
    m.umount()                                  # rc 0: the report was there and lost nothing
    report = json.loads((Path(st["state_dir"]) / UNMOUNT_REPORT).read_text())
    assert report["pid"] == st["pid"] and report["lost"] == 0
