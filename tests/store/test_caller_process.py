"""The commit path's hold on its caller (kvfs.store.commit.CallerProcess)."""
from __future__ import annotations

import os
import resource
import subprocess

import pytest

from kvfs.store.commit import CallerProcess


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
