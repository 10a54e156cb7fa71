"""Issue 40, item 1: LMDB's ``lock.mdb`` on a full state filesystem. LMDB makes the lock file
with ``ftruncate`` (sparse) and writes its reader table through a shared mapping: on a full
filesystem the first write to its page was a SIGBUS that killed the opening process. The
daemon now gives the file its blocks with ``fallocate`` before LMDB maps it: ENOSPC, refused
in one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

OPEN = """
import sys
from pathlib import Path
from kvfs.errors import ConfigError
from kvfs.store.lmdbfile import open_env
try:
    open_env(Path(sys.argv[1]), 1 << 30, Path(sys.argv[1]).parent).close()
except ConfigError as e:
    print("refused:", e)
    sys.exit(3)
print("opened")
"""


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs of the test's own (root only)."""
    where = tmp_path / "fs"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if r.returncode:
        pytest.skip("cannot mount a tmpfs here (root only)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(where: Path) -> None:
    fd = os.open(where / "filler", os.O_CREAT | os.O_WRONLY, 0o600)
    chunk = b"x" * 65536
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError:
                if len(chunk) == 1:
                    return
                chunk = chunk[:len(chunk) // 2]
    finally:
        os.close(fd)


def run_open(env: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", OPEN, str(env)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_full_state_filesystem_refuses_the_index_instead_of_sigbus(small_fs):
    env = small_fs / "index"
    first = run_open(env)
    assert first.returncode == 0 and "opened" in first.stdout, first.stderr
    (env / "lock.mdb").unlink()             # as after a crash on another filesystem, or a first mount
    fill(small_fs)
    full = run_open(env)
    assert full.returncode == 3, (full.returncode, full.stdout, full.stderr[-1000:])   # -7 was SIGBUS
    assert "full" in full.stdout
    (small_fs / "filler").unlink()
    again = run_open(env)                   # room again: opens, and keeps its lock file backed
    assert again.returncode == 0, again.stderr
    st = os.stat(env / "lock.mdb")
    assert st.st_blocks * 512 >= st.st_size
