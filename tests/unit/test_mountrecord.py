"""The mount record a daemon leaves for ``kvfs umount`` of its mount after it died
(kvfs/mountrecord.py): believed only where nobody else could have written it."""
from __future__ import annotations

import os

import pytest

from kvfs import mountrecord


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    d = tmp_path / "run"
    monkeypatch.setattr(mountrecord, "run_dir", lambda: d)
    return d


def test_written_read_and_removed_by_its_daemon_only(run_dir):
    mountrecord.write("/mnt/a", {"pid": 123, "state_dir": "/s"})
    assert run_dir.stat().st_mode & 0o777 == 0o700
    rec = mountrecord.read("/mnt/a")
    assert rec == {"pid": 123, "state_dir": "/s", "mountpoint": "/mnt/a"}
    assert mountrecord.read("/mnt/b") is None
    mountrecord.remove("/mnt/a", pid=456)          # another daemon's exit leaves it
    assert mountrecord.read("/mnt/a") is not None
    mountrecord.remove("/mnt/a", pid=123)
    assert mountrecord.read("/mnt/a") is None


def test_a_record_others_may_write_is_not_believed(run_dir):
    mountrecord.write("/mnt/a", {"pid": 123})
    path = mountrecord.record_path("/mnt/a")
    os.chmod(path, 0o666)
    assert mountrecord.read("/mnt/a") is None
    os.chmod(path, 0o600)
    os.chmod(run_dir, 0o777)
    assert mountrecord.read("/mnt/a") is None


def test_a_record_naming_another_mountpoint_is_not_believed(run_dir):
    mountrecord.write("/mnt/a", {"pid": 123})
    os.replace(mountrecord.record_path("/mnt/a"), mountrecord.record_path("/mnt/b"))
    assert mountrecord.read("/mnt/b") is None


def test_records_of_gone_daemons_whose_mounts_are_gone_are_pruned(run_dir):
    mountrecord.write("/nonexistent/gone", {"pid": 1 << 22})      # no such pid, not mounted
    mountrecord.write("/nonexistent/live", {"pid": os.getpid()})
    mountrecord.write("/nonexistent/new", {"pid": 1 << 22})       # the one being written stays
    assert mountrecord.read("/nonexistent/gone") is None
    assert mountrecord.read("/nonexistent/live") is not None
    assert mountrecord.read("/nonexistent/new") is not None
