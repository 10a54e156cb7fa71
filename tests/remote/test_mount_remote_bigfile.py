"""Issue 34 (1) on the remote tier: a big file through a real mount onto the real
nvmet-tcp target (QEMU), with RAM and local NVMe too small to hold it.

The file spills out of RAM, goes to the remote volume at close (its record header there
grows with its per-MiB checksums: 3 units for 1 GiB, no fixed slot), evicts nothing,
reads back byte-exact through the daemon (every 1 MiB chunk checked against its sum on
the way up from the volume), and again after a remount re-reads the volume's table.
The 1 GiB run is ``slow`` (minutes under TCG); the default run writes 600 MiB, over the
~480 MiB at which an NVMe record used to overflow ext4's xattr cap.
"""
from __future__ import annotations

import pytest

from support.bigfile import GiB, MiB, check_big, write_big
from support.files import put, tier_of
from support.mount import wait_for
from support.target import _boot

pytestmark = [pytest.mark.mount, pytest.mark.target]


def settled(m) -> dict:
    return wait_for(lambda: (lambda s: s if s["settled"] else None)(m.stats()), 600, "the store to settle")


@pytest.mark.parametrize("size", [600 * MiB, pytest.param(GiB, marks=pytest.mark.slow)],
                         ids=["600MiB", "1GiB"])
def test_a_big_file_on_the_remote_tier(kvfs_mount, tmp_path, size):
    target = _boot(tmp_path / "namespace.img", size=size + 256 * MiB)
    try:
        m = kvfs_mount(ram="32MiB", nvme_size="64MiB", remote=target.url)
        others = {}
        for i in range(8):
            p = m.path / "others" / f"{i}.bin"
            others[p] = bytes([i + 1]) * (4 * MiB)
            put(p, others[p])
        big = m.path / "model" / "big.bin"
        big.parent.mkdir()
        write_big(big, size)
        settled(m)
        assert tier_of(big) == "remote"
        st = m.stats()
        assert sum(t["evictions"] for t in st["tiers"].values()) == 0, st["tiers"]
        assert check_big(big, size) is None
        m.remount()
        assert tier_of(big) == "remote"
        assert check_big(big, size) is None
        st = m.stats()
        assert sum(t["checksum_failures"] for t in st["tiers"].values()) == 0, st["tiers"]
        for p, data in others.items():
            with open(p, "rb") as f:
                assert f.read() == data, p
    finally:
        target.kill()
