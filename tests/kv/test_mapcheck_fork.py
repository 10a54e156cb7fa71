"""The PROCMAP_QUERY descriptor of kvfs.kv.mapcheck after fork(): a child asks about its own
address space, not about its parent's (the descriptor opened by the parent is inherited)."""
from __future__ import annotations

import mmap
import os

import pytest

from kvfs.kv import mapcheck


def test_a_forked_child_queries_its_own_mappings(tmp_path):
    here = bytearray(4096)
    try:
        mapcheck._query(id(here))       # the parent opens (and keeps) its descriptor
    except OSError:
        pytest.skip("no PROCMAP_QUERY on this kernel")
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 8192)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:                      # pragma: no cover - the child
        ok = b"?"
        try:
            with open(path, "r+b") as f:
                m = mmap.mmap(f.fileno(), 8192)    # mapped in the child only
                addr = mapcheck.ctypes.addressof(mapcheck.ctypes.c_char.from_buffer(m))
                got = mapcheck._query(addr)
                ok = b"1" if got and got[0] == addr and got[2] == os.stat(path).st_dev else b"0"
        finally:
            os.write(w, ok)
            os._exit(0)
    os.close(w)
    try:
        answer = os.read(r, 1)
    finally:
        os.close(r)
        os.waitpid(child, 0)
    assert answer == b"1", "the child's query saw its parent's address space"
