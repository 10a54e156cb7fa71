"""Idle passthrough registrations (kvfs/fs/passthrough.py): the backing registration of a
sealed block outlives its last open, so a re-read of the block skips the open, check and
registration of its tier file; it serves only that version, and it is closed before the store
moves, frees or replaces the copy it holds (``.kvfs/stats`` transport.passthrough: ``reused``,
``idle``, ``idle_closed``)."""
from __future__ import annotations

import os

import pytest

from support.files import MiB, content, read
from support.mount import wait_for

pytestmark = pytest.mark.mount


def passthrough(m) -> dict:
    return m.stats()["transport"]["passthrough"]


def read_released(m, p) -> bytes:
    """``p``'s bytes, once the daemon has the RELEASE of that open (the kernel sends it after
    close(2) returns: a next open could come first and share the registration instead)."""
    got = read(p)
    wait_for(lambda: passthrough(m)["held"] == 0, 60, "the RELEASE")
    return got


def settled_pt(m) -> dict:
    """The passthrough counters once the store has settled (its moves done)."""
    return wait_for(lambda: (st := m.stats())["settled"] and st["transport"]["passthrough"], 60, "settled")


def test_a_reread_reuses_the_idle_registration(kvfs_mount):
    m = kvfs_mount("--passthrough", ram="64MiB")
    p, data = m.path / "b.kv", content("b", 2 * MiB + 4097)
    p.write_bytes(data)
    before = passthrough(m)
    assert read_released(m, p) == data
    first = passthrough(m)
    assert first["registered"] == before["registered"] + 1 and first["idle"] == before["idle"] + 1
    reads = m.stats()["transport"]["data_reads"]
    for _ in range(3):                                   # the same file again: no new registration
        assert read_released(m, p) == data
    again = passthrough(m)
    assert again["registered"] == first["registered"] and again["reused"] == first["reused"] + 3
    assert again["opens"] == first["opens"] + 3 and again["held"] == 0 and again["idle"] == first["idle"]
    assert m.stats()["transport"]["data_reads"] == reads, "a passthrough read reached the daemon"


@pytest.mark.parametrize("how", ["o_trunc", "rdwr"])
def test_a_new_version_never_gets_the_idle_registration(kvfs_mount, how):
    """The kernel let the inode's backing go at the last close: a cached writer opens it (no
    EIO, no ETXTBSY, no renewal), and the new version's reader gets a new registration."""
    m = kvfs_mount("--passthrough", ram="64MiB")
    p, old = m.path / "f.kv", content("old", 3 * MiB)
    p.write_bytes(old)
    ino = os.stat(p).st_ino
    assert read_released(m, p) == old
    before = passthrough(m)
    assert before["idle"] == 1
    if how == "o_trunc":
        new = content("new", 2 * MiB + 5)
        with open(p, "wb") as f:
            f.write(new)
    else:
        fd = os.open(p, os.O_RDWR)
        try:
            assert os.pwrite(fd, b"new", 0) == 3
        finally:
            os.close(fd)
        new = b"new" + old[3:]
    assert os.stat(p).st_ino == ino, "renewed: the kernel still held the inode"
    assert read_released(m, p) == new and read_released(m, p) == new
    after = settled_pt(m)
    assert after["renewed"] == before["renewed"] and after["busy"] == before["busy"]
    assert after["registered"] == before["registered"] + 1 and after["reused"] == before["reused"] + 1
    assert after["idle"] == 1 and after["idle_closed"] == before["idle_closed"] + 1


@pytest.mark.parametrize("change", ["replace", "unlink"])
def test_an_idle_registration_goes_with_its_version(kvfs_mount, change):
    m = kvfs_mount("--passthrough", ram="64MiB")
    p, data = m.path / "f.kv", content("f", 3 * MiB)
    p.write_bytes(data)
    assert read_released(m, p) == data
    before = settled_pt(m)
    used = m.stats()["tiers"]["ram"]["used"]
    if change == "replace":
        other = m.path / "other.kv"
        other.write_bytes(content("other", MiB))
        os.replace(other, p)
    else:
        p.unlink()
    after = settled_pt(m)
    assert after["idle"] == before["idle"] - 1 and after["idle_closed"] == before["idle_closed"] + 1
    assert m.stats()["tiers"]["ram"]["used"] <= used - len(data) + (MiB if change == "replace" else 0)
    if change == "replace":
        assert read_released(m, p) == content("other", MiB)


def test_an_idle_registration_is_closed_when_its_copy_is_demoted(kvfs_mount):
    m = kvfs_mount("--passthrough", ram="16MiB", nvme_size="256MiB")
    p, data = m.path / "held.kv", content("held", 4 * MiB)
    p.write_bytes(data)
    assert read_released(m, p) == data
    before = settled_pt(m)
    assert before["idle"] == 1
    for i in range(12):                                  # 24 MiB through 16 MiB of RAM
        (m.path / f"push{i}.kv").write_bytes(content(f"push{i}", 2 * MiB))
    wait_for(lambda: m.stats()["settled"] and os.getxattr(p, "user.kvfs.tier") == b"nvme", 120, "held.kv on NVMe")
    after = settled_pt(m)
    assert after["idle"] == 0 and after["idle_closed"] == before["idle_closed"] + 1
    assert read_released(m, p) == data                               # the NVMe copy, checked and registered
    nvme = settled_pt(m)
    assert nvme["registered"] == after["registered"] + 1
    if os.getxattr(p, "user.kvfs.tier") == b"ram":       # that read promoted it: the NVMe one went
        # (closed as idle if the promotion came after the RELEASE, at the RELEASE if before)
        assert nvme["idle"] == 0
        assert read_released(m, p) == data
        nvme = settled_pt(m)
        assert nvme["registered"] == after["registered"] + 2
    tier = os.getxattr(p, "user.kvfs.tier")
    assert read_released(m, p) == data          # again: a RAM copy is reused, an NVMe one checked anew
    last = passthrough(m)
    if tier == b"nvme" and os.getxattr(p, "user.kvfs.tier") == b"nvme":
        assert last["registered"] == nvme["registered"] + 1 and last["reused"] == nvme["reused"]
    elif tier == b"ram":
        assert last["registered"] == nvme["registered"] and last["reused"] == nvme["reused"] + 1


def test_idle_registrations_are_bounded(kvfs_mount):
    from kvfs.fs.passthrough import IDLE_MAX
    m = kvfs_mount("--passthrough", ram="64MiB")
    files = {m.path / f"s{i}.kv": content(f"s{i}", 256 * 1024 + i) for i in range(IDLE_MAX + 6)}
    for p, data in files.items():
        p.write_bytes(data)
    before = passthrough(m)
    for p, data in files.items():
        assert read_released(m, p) == data
    after = passthrough(m)
    assert after["registered"] == before["registered"] + len(files)
    assert after["idle"] == IDLE_MAX and after["idle_closed"] == before["idle_closed"] + 6
    first, last = list(files)[0], list(files)[-1]
    assert read_released(m, last) == files[last] and read_released(m, first) == files[first]     # the newest kept, the oldest gone
    again = passthrough(m)
    assert again["reused"] == after["reused"] + 1 and again["registered"] == after["registered"] + 1
