"""FUSE passthrough on this kernel, checked through the spike server of issue 30
(benchmarks/passthrough_spike.py: our own /dev/fuse server, no kvfs code).

Facts the passthrough design rests on: a file opened with FOPEN_PASSTHROUGH is read by the
kernel from its backing file (read, pread, mmap: right bytes, zero READ requests reach the
daemon); a reader holding it open keeps the version it opened when the backing file is replaced
or unlinked; the kernel refuses a second open of the same FUSE inode on a different backing
file; without CAP_SYS_ADMIN the backing registration is EPERM and the plain path still serves.
Skipped where the kernel does not offer passthrough or mount(2) is not allowed.
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "benchmarks" / "passthrough_bench.py"
pytestmark = pytest.mark.mount


@pytest.fixture(scope="module")
def bench():
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root (the spike mounts with mount(2))")
    spec = importlib.util.spec_from_file_location("passthrough_bench_for_test", SRC)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def spike(bench, tmp_path: Path, *flags: str):
    m = bench.SpikeMount(tmp_path / "mnt", tmp_path / "back", *flags)
    m.__enter__()
    neg = m.stats()["negotiated"]
    if "--no-passthrough" not in flags and not neg["passthrough"]:
        m.__exit__(None, None, None)
        pytest.skip(f"the kernel did not negotiate FUSE_PASSTHROUGH: {neg}")
    return m


@pytest.fixture
def mounted(bench, tmp_path):
    m = spike(bench, tmp_path)
    try:
        yield m
    finally:
        m.__exit__(None, None, None)


def reads(stats: dict) -> int:
    return stats["requests"].get("read", 0)


def test_passthrough_read_and_mmap_never_reach_the_daemon(mounted):
    data = os.urandom(3 << 20) + b"tail"                 # not a multiple of the page size
    (mounted.backing / "block.bin").write_bytes(data)
    before = mounted.stats()
    fd = os.open(mounted.mnt / "block.bin", os.O_RDONLY)
    try:
        got = bytearray()
        while chunk := os.read(fd, 1 << 20):
            got += chunk
        assert got == data
        assert os.pread(fd, 4096, len(data) - 4096) == data[-4096:]
        for flags in (mmap.MAP_SHARED, mmap.MAP_PRIVATE):
            with mmap.mmap(fd, len(data), flags=flags, prot=mmap.PROT_READ) as mm:
                assert mm[:] == data
    finally:
        os.close(fd)
    after = mounted.stats()
    assert after["passthrough_opens"] - before["passthrough_opens"] == 1
    assert after["backing_error"] is None
    assert reads(after) - reads(before) == 1              # the stats file's own read, no data read


def test_a_held_passthrough_file_keeps_its_version(mounted):
    old, new = b"o" * (1 << 20), b"n" * (1 << 20)
    (mounted.backing / "v.bin").write_bytes(old)
    fd = os.open(mounted.mnt / "v.bin", os.O_RDONLY)
    try:
        (mounted.backing / "v.tmp").write_bytes(new)
        os.replace(mounted.backing / "v.tmp", mounted.backing / "v.bin")
        assert os.pread(fd, len(old), 0) == old
        # the same FUSE inode on another backing file, while the first is open: refused
        with pytest.raises(OSError) as err:
            (mounted.mnt / "v.bin").read_bytes()
        assert err.value.errno == 5                       # EIO
        os.unlink(mounted.backing / "v.bin")
        assert os.pread(fd, len(old), 0) == old
    finally:
        os.close(fd)
    (mounted.backing / "v.bin").write_bytes(new)
    assert (mounted.mnt / "v.bin").read_bytes() == new    # once closed, the inode takes the new one


def test_without_cap_sys_admin_registration_is_eperm_and_reads_still_work(bench, tmp_path):
    m = spike(bench, tmp_path, "--drop-sys-admin")
    try:
        data = os.urandom(1 << 20)
        (m.backing / "c.bin").write_bytes(data)
        assert (m.mnt / "c.bin").read_bytes() == data
        s = m.stats()
        assert s["negotiated"]["passthrough"] and s["passthrough_opens"] == 0
        assert s["backing_error"].startswith("EPERM")
        assert reads(s) >= 2                              # served by READ requests
    finally:
        m.__exit__(None, None, None)


def test_one_backing_per_inode_serves_every_open_and_release_waits_for_munmap(bench, tmp_path):
    m = spike(bench, tmp_path, "--per-inode", "--noflush")
    try:
        data = os.urandom(2 << 20)
        (m.backing / "b.bin").write_bytes(data)
        before = m.stats()
        fds = [os.open(m.mnt / "b.bin", os.O_RDONLY) for _ in range(3)]
        assert all(os.pread(fd, len(data), 0) == data for fd in fds)
        mm = mmap.mmap(fds[0], len(data), prot=mmap.PROT_READ)
        for fd in fds:
            os.close(fd)
        mid = m.stats()
        assert mid["backing_opens"] - before["backing_opens"] == 1     # registered once
        assert mid["passthrough_opens"] - before["passthrough_opens"] == 3
        assert reads(mid) - reads(before) == 1                        # the stats file's own
        assert mid["requests"].get("flush", 0) == before["requests"].get("flush", 0)
        # two of the three were released at close; the mapped one is not released yet
        assert bench.wait_until(lambda: m.stats()["data_releases"] - before["data_releases"] == 2, 30)
        assert mm[:] == data
        assert m.stats()["data_releases"] - before["data_releases"] == 2
        mm.close()
        assert bench.wait_until(lambda: m.stats()["data_releases"] - before["data_releases"] == 3, 30)
    finally:
        m.__exit__(None, None, None)


def test_an_inode_takes_no_second_registration_while_it_is_open(bench, tmp_path):
    """The daemon closing an inode's backing id (as at eviction) leaves its readers reading;
    a fresh id for the same inode, even on the same file, is EIO until the last RELEASE."""
    spike(bench, tmp_path / "check").__exit__(None, None, None)   # skips without passthrough
    res = bench.probe_close_id_while_open(tmp_path)
    assert res == {"ids_closed": 1, "held_fd_after_id_close": True,
                   "held_mmap_after_id_close": True,
                   "new_open_new_id_while_held": "OSError: Input/output error",
                   "new_open_new_id_after_release": True}
