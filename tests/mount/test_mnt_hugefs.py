"""The RAM tier on a huge-page tmpfs the daemon mounts itself (kvfs/store/hugefs.py,
docs/operations.md "A RAM tier on huge pages"): mounted fresh at start, unmounted at a clean
unmount, a killed daemon's one swept by the next start of the same state, a look-alike
directory of another user left alone; ``ram_hugefs = false`` keeps the tier in shm_dir."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.files import content, put, read
from support.mount import run_kvfs
from kvfs.proc import filesystem_of

pytestmark = pytest.mark.mount


def own_fs(m) -> Path | None:
    top = Path(m.stats()["ram_dir"]).parent
    return top if ".hugefs-" in top.name else None


def test_the_ram_tier_gets_a_huge_page_tmpfs_of_its_own(kvfs_mount, intruder):
    m = kvfs_mount(ram="64MiB")
    top = own_fs(m)
    if top is None:
        assert os.geteuid() != 0, "root, and the RAM tier is not on a tmpfs of its own"
        pytest.skip("not root: the daemon cannot mount its tmpfs (the tier stays in /dev/shm)")
    mnt, fstype, opts = filesystem_of(top)
    assert (mnt, fstype, opts.get("huge")) == (str(top), "tmpfs", "within_size")
    assert top.parent == Path("/dev/shm") and (top.stat().st_mode & 0o7777) == 0o755
    instance = m.stats()["instance"]
    data = content("h", 3 << 20)
    put(m.path / "blk", data)
    assert read(m.path / "blk") == data
    # another user's directory named like ours is not mounted over and not removed
    planted = f"/dev/shm/kvfs-{instance}.hugefs-planted"
    intruder.run("import os,sys; os.mkdir(sys.argv[1])", planted)
    try:
        m.kill9()
        assert os.path.ismount(top)                  # what the killed daemon left
        m.mount()
        assert not os.path.exists(top), "the killed daemon's tmpfs was not swept"
        new = own_fs(m)
        assert new is not None and new != top and os.path.ismount(new)
        assert os.path.isdir(planted) and not os.path.ismount(planted)
        m.umount()
        assert not os.path.exists(new), "a clean unmount left the tmpfs mounted"
    finally:
        os.rmdir(planted)


def test_ram_hugefs_false_keeps_the_tier_in_shm_dir(kvfs_mount, tmp_path):
    cfg = tmp_path / "plain.toml"
    cfg.write_text("[kvfs]\nram_hugefs = false\n")
    m = kvfs_mount("--config", cfg)
    assert Path(m.stats()["ram_dir"]).parent == Path("/dev/shm")
    cfg.write_text('[kvfs]\nram_hugefs = "yes"\n')
    (tmp_path / "mnt2").mkdir()
    r = run_kvfs("mount", tmp_path / "mnt2", "--config", cfg, "--nvme", tmp_path / "n2")
    assert r.returncode != 0 and "ram_hugefs must be true or false" in r.stderr
