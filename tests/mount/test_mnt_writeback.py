"""The kernel's writeback cache (config ``writeback_cache``, off): the experiment of
docs/design.md "How a read travels", kept as the facts that decided it. With it on, the bytes
still reach the daemon before close(2) returns and read back right, but the first stat(2) after
a write still reaches the daemon (the kernel marks ``st_blocks`` stale at close), every written
file costs a SETATTR more, passthrough is off, and a write the daemon refuses fails only at
close. If a kernel changes any of these, measure again (``benchmarks/runtime_patterns.py
--targets kvfs,kvfs_wb,plain``)."""
from __future__ import annotations

import errno
import os

import pytest

from support.files import content, errno_of, read

pytestmark = pytest.mark.mount

N = 20


def ops(m) -> dict:
    return m.stats()["transport"]["by_opcode"]


def test_writeback_cache_saves_no_getattr_and_moves_write_errors_to_close(kvfs_mount, tmp_path):
    cfg = tmp_path / "wb.toml"
    cfg.write_text("[kvfs]\nwriteback_cache = true\npassthrough = true\n")
    m = kvfs_mount("--config", cfg)
    tr = m.stats()["transport"]
    if tr["name"] != "kernel":
        pytest.skip("the writeback cache is asked for by kvfs's own transport only")
    assert tr["writeback_cache"] is True
    assert not tr["passthrough"]["state"].startswith("on")     # the kernel allows one or the other
    d = m.path / "wb"
    d.mkdir()
    before = ops(m)
    for i in range(N):
        p = d / f"f{i}"
        p.write_bytes(content(f"f{i}", 32 << 10))
        assert os.stat(p).st_size == 32 << 10
    after = ops(m)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("getattr", "setattr", "write")}
    assert grew["write"] >= N                 # written back before each close returned
    assert grew["setattr"] >= N               # the kernel's mtime, sent at close
    assert grew["getattr"] >= N               # each first stat still asked the daemon
    for i in range(N):
        assert read(d / f"f{i}") == content(f"f{i}", 32 << 10)
    # the daemon's refusal reaches the writer only at close, as EIO (EFBIG at once without it)
    fd = os.open(d / "far", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert errno_of(os.pwrite, fd, b"x", 999_999_999_999_999) is None
    finally:
        assert errno_of(os.close, fd) == errno.EIO
