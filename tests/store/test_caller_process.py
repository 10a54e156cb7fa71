"""The commit path's hold on its caller (kvfs.store.caller.CallerProcess)."""
from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys

import pytest

from kvfs.errors import NamespaceError
from kvfs.store.caller import CallerProcess


@pytest.fixture
def high_fd():
    """A descriptor number past select()'s 1024, as a daemon holding many objects open has."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if want <= 1100:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} leaves no descriptor past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    try:
        yield want - 7
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_caller_is_seen_alive_and_gone_through_a_descriptor_past_1024(high_fd):
    # select() refused such a descriptor (ValueError), and every commit of a daemon with
    # ~1000 objects open failed with EIO (benchmarks/runtime_adapters.py --pages 1000)
    child = subprocess.Popen(["sleep", "60"])
    try:
        c = CallerProcess(child.pid)
        os.dup2(c.pidfd, high_fd)
        os.close(c.pidfd)
        c.pidfd = high_fd
        assert c.alive()
        child.kill()
        child.wait()
        assert not c.alive()
        c.close()
        assert c.pidfd == -1 and not c.alive()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


CHILD_MEMORY = r"""
import ctypes, sys
data = bytearray(b"c" * 300000)
print(ctypes.addressof(ctypes.c_char.from_buffer(data)), flush=True)
sys.stdin.read()
"""


def test_the_callers_memory_is_read_while_it_lives_and_esrch_once_it_is_gone():
    child = subprocess.Popen([sys.executable, "-c", CHILD_MEMORY], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    c = CallerProcess(child.pid)
    try:
        at = int(child.stdout.readline())
        mem = c.memory(os.geteuid())
        assert mem.read(((at, 300000),), 300000) == b"c" * 300000
        assert mem.read(((at + 299990, 10), (at, 5)), 15) == b"c" * 15
        buf = memoryview(bytearray(7))
        assert mem.readinto(buf, ((at, 3), (at + 100, 3), (at + 200, 3)), 2) == 7
        with pytest.raises(OSError) as e:
            mem.read(((at + 299990, 1 << 30),), 1 << 30)   # past what the process maps
        assert e.value.errno == errno.EFAULT
        with pytest.raises(OSError) as e:
            mem.read(((at, 10),), 20)       # the ranges hold fewer bytes than asked
        assert e.value.errno == errno.EFAULT
        with pytest.raises(NamespaceError) as e:
            c.memory(os.geteuid() + 1)      # not the owner of /proc/<pid>: as if not dumpable
        assert e.value.errno == errno.EPERM
        child.kill()
        child.wait()
        with pytest.raises(OSError) as e:
            mem.read(((at, 4096),), 4096)
        assert e.value.errno == errno.ESRCH
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        c.close()
