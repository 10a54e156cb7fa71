"""Issue 40, item 6: nothing staged outlives the descriptors that wrote it. The exerciser (tests/fsx)
renames over names held open by writers, unlinks open files and truncates buffers back below
``ram_mapped_min``; the buffers those versions leave behind were emptied and kept, named and
open, in the RAM tier's ``staging/`` for later writes ("spares"), with nobody writing: files
left in ``staging/`` after every descriptor closed and the store said settled."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from support.files import content, read
from support.mount import wait_for

pytestmark = pytest.mark.mount

KiB = 1 << 10


def writer(d: Path, k: int, rounds: int, errors: list) -> None:
    try:
        for r in range(rounds):
            held = d / f"w{k}-{r % 3}"
            fd = os.open(held, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                os.write(fd, content(f"held{k}{r}", 300 * KiB))    # a tmpfs buffer (past mapped_min)
                tmp = d / f".w{k}-{r}.tmp"
                tmp.write_bytes(content(f"new{k}{r}", 40 * KiB))
                os.rename(tmp, held)                               # over the name held open
                os.write(fd, b"more")
                if r % 2:
                    os.ftruncate(fd, 10 * KiB)                     # back below mapped_min
            finally:
                os.close(fd)
            assert read(held) == content(f"new{k}{r}", 40 * KiB)
            if r % 4 == 3:
                gone = d / f"u{k}"
                fd = os.open(gone, os.O_CREAT | os.O_WRONLY, 0o644)
                os.write(fd, content("u", 400 * KiB))
                os.unlink(gone)                                    # unlinked while open
                os.write(fd, b"tail")
                os.close(fd)
    except BaseException as e:      # noqa: BLE001 -- reported by the test
        errors.append(e)


def test_nothing_staged_outlives_its_writers(kvfs_mount):
    m = kvfs_mount(ram="8MiB", nvme_size="64MiB")
    d = m.path / "ns"
    d.mkdir()
    errors: list = []
    threads = [threading.Thread(target=writer, args=(d, k, 8, errors)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    wait_for(lambda: (lambda s: s["open_handles"] == 0 and s["settled"])(m.stats()), 60,
             "every release processed and the store settled")
    st = m.stats()
    staging = Path(st["ram_dir"]) / "staging"
    assert sorted(os.listdir(staging)) == []
    assert st["tiers"]["ram"]["staged"] == 0
    nvme_staging = m.nvme / "staging"
    assert sorted(os.listdir(nvme_staging)) == []
    m.umount()
