"""Issue 40, item 2: what a past tenant left in the daemon's directories (a tree deeper than
Python's recursion limit, symlinks out, a fifo) is removed without recursion and without
following links, by ``clear_dir`` and by every start that empties a directory of the daemon's
(the NVMe tier's ``grants/`` and ``staging/``, a dead daemon's RAM-tier directory); the
starts report what was not theirs."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from kvfs.store import safedir
from kvfs.store.nvme import NvmeTier
from kvfs.store.ram import RamTier
from support.planted import DEPTH, plant


def test_clear_dir_removes_a_tree_deeper_than_the_recursion_limit(tmp_path):
    outside = plant(tmp_path / "victim")
    fd = os.open(tmp_path / "victim", safedir.DIR_FLAGS)
    try:
        got = safedir.clear_dir(fd)
    finally:
        os.close(fd)
    assert os.listdir(tmp_path / "victim") == []
    assert (outside / "precious").read_bytes() == b"keep me"     # no symlink was followed
    assert got == DEPTH + 5      # the chain, its file, 3 symlinks, the fifo


def test_clear_dir_keeps_few_descriptors_open(tmp_path):
    plant(tmp_path / "victim")
    before = len(os.listdir("/proc/self/fd"))
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 8, hard))     # depth may not cost fds
    try:
        fd = os.open(tmp_path / "victim", safedir.DIR_FLAGS)
        try:
            safedir.clear_dir(fd)
        finally:
            os.close(fd)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert os.listdir(tmp_path / "victim") == []


def test_classify_names_what_is_not_the_daemons(tmp_path):
    d = tmp_path / "grants"
    plant(d / "1000", outside=tmp_path / "out")
    (d / "1001").mkdir()
    (d / "1001" / ("0" * 16)).write_bytes(b"")       # a link the daemon made: ours
    fd = os.open(d, safedir.DIR_FLAGS)
    try:
        cleared = safedir.clear_dir(fd, ours=safedir.grants_entry)
    finally:
        os.close(fd)
    assert os.listdir(d) == []
    assert cleared == DEPTH + 5 + 3
    assert cleared.foreign == {"directory": DEPTH, "file": 1, "symlink": 3, "fifo": 1}
    assert cleared.deepest == DEPTH + 2
    text = cleared.describe()
    assert "1600 directories" in text and "3 symlinks" in text and "1 fifo" in text and "1602 deep" in text


async def test_nvme_open_empties_planted_grants_and_staging_and_reports_them(tmp_path):
    t = NvmeTier(8 << 20, tmp_path / "nvme")
    await t.open()
    await t.close()
    outside = plant(tmp_path / "nvme" / "grants" / "1000", outside=tmp_path / "out")
    plant(tmp_path / "nvme" / "staging" / "x", outside=tmp_path / "out2")
    t = NvmeTier(8 << 20, tmp_path / "nvme")
    await t.open()
    try:
        assert os.listdir(tmp_path / "nvme" / "grants") == []
        assert os.listdir(tmp_path / "nvme" / "staging") == []
        assert (outside / "precious").read_bytes() == b"keep me"
        assert len(t.foreign) == 2, t.foreign
        assert any("grants" in f and "1600 directories" in f for f in t.foreign), t.foreign
    finally:
        await t.close()


async def test_ram_open_removes_a_dead_daemons_directory_with_a_planted_tree(tmp_path):
    instance = uuid.uuid4().hex
    stale = f"/dev/shm/kvfs-{instance}-dead"
    os.mkdir(stale, 0o700)
    try:
        outside = plant(Path(stale) / "grants", outside=tmp_path / "outside")
        t = RamTier(4 << 20, "/dev/shm", instance)
        await t.open()
        await t.close()
        assert not os.path.lexists(stale)
        assert (outside / "precious").read_bytes() == b"keep me"
    finally:
        if os.path.lexists(stale):
            fd = os.open(stale, safedir.DIR_FLAGS)
            safedir.clear_dir(fd)
            os.close(fd)
            os.rmdir(stale)
