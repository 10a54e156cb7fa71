"""Two kvfs daemons on one shared volume (format 2), through their mounts.

A and B: separate state dirs, NVMe dirs, mounts and host NQNs, one volume. A writes 40 blocks
of 1 MiB with tiny RAM/NVMe budgets so some demote to the remote volume; B then finds, lists
and reads exactly those byte-equal without having written them. A frees one and rewrites
another: once B has tailed A's log, B gets a miss for both (never the old bytes). On the real
nvmet-tcp target (marked target) and, cheaper, on a file volume.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from support.files import put, tier_of  # noqa: F401
from support.mount import run_kvfs, wait_for
from support.share import MiB, caught_up, content, outcome, share  # noqa: F401

NFILES = 40


def rel(i: int) -> str:
    return f"model_cfg/{i % 4:03x}/{i:02x}_g0/blk{i:04d}.bin"


def settled(m) -> bool:
    st = m.stats()
    return st["settled"] and all(st["tiers"][t]["used"] <= 0.9 * st["tiers"][t]["capacity"]
                                 for t in ("ram", "nvme"))


def two_nodes(kvfs_mount, tmp_path, remote_a: str, remote_b: str, **extra) -> None:
    cfg = tmp_path / "share.toml"
    cfg.write_text("share = true\nshare_poll = 0.1\nshare_max_nodes = 2\n")
    a = kvfs_mount(ram="8MiB", nvme_size="16MiB", remote=remote_a, config=cfg, node_id="node-a", **extra)
    b = kvfs_mount(ram="8MiB", nvme_size="16MiB", remote=remote_b, config=cfg, node_id="node-b", **extra)
    assert share(a)["slot"] != share(b)["slot"] and share(a)["region"] != share(b)["region"]
    files = {i: a.path / rel(i) for i in range(NFILES)}
    for i, p in files.items():
        put(p, content(i))
    wait_for(lambda: settled(a) and sum(tier_of(p) == "remote" for p in files.values()) >= 8, 180,
             "A to demote blocks to the shared volume")
    remote = [i for i, p in files.items() if tier_of(p) == "remote"]
    wait_for(lambda: caught_up(b, a), 60, "B to tail A's log")
    assert share(a)["published"] >= len(remote)

    # B lists, stats and reads A's demoted blocks, byte-equal
    d = remote[0] % 4
    in_dir = {Path(rel(i)).parent.name for i in remote if i % 4 == d}
    assert in_dir <= set(os.listdir(b.path / f"model_cfg/{d:03x}"))
    # the one-call prefix lookup (.kvfs/lookup) finds them too (those in other directories
    # are adopted by it: nothing looked them up before)
    from kvfs.kv.lookup import transact
    fd = os.open(b.path / ".kvfs" / "lookup", os.O_RDWR)
    try:
        unseen = [rel(i) for i in range(NFILES) if i in remote and i % 4 != d]
        assert unseen
        answer = json.loads(transact(fd, ("\n".join(unseen) + "\n").encode()))
    finally:
        os.close(fd)
    assert answer["prefix"] == len(unseen) and set(answer["tiers"]) == {"remote"}, answer
    for i in remote:
        p = b.path / rel(i)
        assert os.stat(p).st_size == MiB
        assert outcome(p) == content(i), rel(i)
        assert tier_of(p) == "remote"
    local = next(i for i, p in files.items() if tier_of(p) in ("ram", "nvme"))
    assert outcome(b.path / rel(local)) == errno.ENOENT       # never demoted: not published
    assert share(b)["adopted"] >= len(remote)
    shown = run_kvfs("stat", b.path)
    assert shown.returncode == 0 and "remote share: node node-b (slot 1" in shown.stdout, shown.stdout
    print(f"{len(remote)} of {NFILES} blocks demoted to the shared volume; B: {share(b)}")

    # A frees one and rewrites another (the new version stays above the remote tier): once B
    # has tailed the frees, both are misses on B, never the old bytes
    gone, rewritten = remote[0], remote[1]
    os.unlink(files[gone])
    put(files[rewritten], content(rewritten, 1))
    wait_for(lambda: share(a)["published"] >= len(remote) + 2 and caught_up(b, a), 60,
             "B to tail A's frees")
    assert outcome(b.path / rel(gone)) == errno.ENOENT
    got = outcome(b.path / rel(rewritten))
    assert got in (errno.ENOENT, content(rewritten, 1)), "B read the old version of a rewritten block"
    assert share(b)["dropped"] >= 2
    for i in remote[2:]:
        assert outcome(b.path / rel(i)) == content(i)

    # B restarts after A freed one more block meanwhile: B drops that adopted name at mount
    # (the view is rebuilt from A's log); the others still read; B's own use of the volume
    # counts only B's records (it wrote none)
    b.umount()
    os.unlink(files[remote[2]])
    wait_for(lambda: share(a)["published"] >= len(remote) + 3, 60, "A to publish the free")
    b.mount()
    assert outcome(b.path / rel(remote[2])) == errno.ENOENT
    assert share(b)["dropped"] >= 1
    assert b.stats()["tiers"]["remote"]["used"] == 0
    for i in remote[3:]:
        assert outcome(b.path / rel(i)) == content(i)
    a.umount()
    b.umount()


@pytest.mark.mount
def test_two_nodes_on_a_shared_file_volume(kvfs_mount, tmp_path):
    vol = tmp_path / "shared.img"
    two_nodes(kvfs_mount, tmp_path, str(vol), str(vol), remote_size="256MiB")


@pytest.mark.mount
@pytest.mark.target
def test_two_nodes_on_the_nvmet_target(kvfs_mount, fresh_target, tmp_path):
    url = fresh_target.url
    sep = "&" if "?" in url else "?"
    two_nodes(kvfs_mount, tmp_path, f"{url}{sep}hostnqn=nqn.2024-01.io.kvfs:node-a",
              f"{url}{sep}hostnqn=nqn.2024-01.io.kvfs:node-b")
    # the same namespace as a format-1 volume: single-node as before, a second instance refused

    def refused(*flags) -> str:
        one = tmp_path / "one"
        (one / "mnt").mkdir(parents=True, exist_ok=True)
        res = run_kvfs("mount", one / "mnt", "--nvme", one / "nvme", "--state", one / "state", "--ram", "8MiB",
                       "--nvme-size", "16MiB", "--remote", url, *flags)
        if res.returncode == 0:
            run_kvfs("umount", one / "mnt")
        assert res.returncode != 0, "a mount that should have been refused was not"
        return res.stderr

    assert "shared volume" in refused()
    first = kvfs_mount(ram="8MiB", nvme_size="16MiB", remote=url, format_remote=True)
    assert "share" not in first.stats()["tiers"]["remote"]
    assert "belongs to kvfs instance" in refused()
    assert "single-node" in refused("--share")
    first.umount()
