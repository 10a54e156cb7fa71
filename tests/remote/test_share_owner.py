"""The taker owns what it takes, through real daemons and mounts (docs/scale-out.md).

A writes blocks that demote to its region; B (no takeover) adopts and reads them; A dies
(kill -9); C takes A's region over, and once it may write there, fills the volume: its own
region first, then A's, where it must free A's blocks (published in C's log). B then misses
every one of A's blocks (never A's old bytes, never C's new ones); C reads all of its own;
A restarted gets a new epoch and another region; ``kvfs remote status`` shows who holds what.
On a file volume (default run) and on the real nvmet-tcp target (marked target and slow).
"""
from __future__ import annotations

import errno
import json

import pytest

from support.files import put, tier_of
from support.mount import run_kvfs, wait_for
from support.share import caught_up, content, outcome, share

LEASE = 4.0


def config(tmp_path, name: str, takeover: bool, max_nodes: int):
    p = tmp_path / f"{name}.toml"
    p.write_text(f"share = true\nshare_poll = 0.1\nshare_max_nodes = {max_nodes}\nshare_lease = {LEASE}\n"
                 f"share_takeover = {'true' if takeover else 'false'}\n")
    return p


def scenario(kvfs_mount, tmp_path, url_of, status_url: str, max_nodes: int = 4, **extra) -> None:
    mk = dict(ram="8MiB", nvme_size="16MiB", **extra)
    a = kvfs_mount(remote=url_of("a"), config=config(tmp_path, "a", False, max_nodes), node_id="node-a", **mk)
    b = kvfs_mount(remote=url_of("b"), config=config(tmp_path, "b", False, max_nodes), node_id="node-b", **mk)
    c = kvfs_mount(remote=url_of("c"), config=config(tmp_path, "c", True, max_nodes), node_id="node-c", **mk)
    files = {f"a/{i:03x}.bin": i for i in range(36)}
    for rel, i in files.items():
        put(a.path / rel, content(i))
    wait_for(lambda: a.stats()["settled"] and sum(tier_of(a.path / r) == "remote" for r in files) >= 6, 180,
             "A to demote blocks to its region")
    on_a = [r for r in files if tier_of(a.path / r) == "remote"]
    wait_for(lambda: caught_up(b, a), 60, "B to tail A's log")
    for r in on_a:                                  # B adopts and reads A's blocks
        assert outcome(b.path / r) == content(files[r]), r
    region_a, epoch_a = share(a)["region"], share(a)["epoch"]

    a.kill9()
    wait_for(lambda: "inherited_objects" in share(c)["held"].get(str(region_a), {}), 120,
             "C to take A's region over and open it")
    held = share(c)["held"][str(region_a)]
    assert held["inherited_objects"] >= len(on_a) and held["own_objects"] == 0
    wait_for(lambda: share(c)["held"][str(region_a)]["writable"], 120, "C to be allowed to write A's region")

    # C fills its region, then A's: A's blocks there must go
    mine, i = [], 1000
    while share(c)["held"][str(region_a)]["inherited_objects"]:
        assert i < 1300, f"C never needed A's space: {share(c)}"
        put(c.path / f"c/{i:04x}.bin", content(i))
        mine.append(i)
        i += 1
        if i % 8 == 0:
            wait_for(lambda: c.stats()["settled"], 120, "C to settle")
    held = share(c)["held"][str(region_a)]
    assert held["reclaimed"] >= len(on_a) and held["own_objects"] >= 1, held
    wait_for(lambda: caught_up(b, c), 60, "B to tail C's frees")
    for r in on_a:
        got = outcome(b.path / r)
        assert got in (errno.ENOENT, errno.EIO), f"B read {r} after C freed it: {got if isinstance(got, int) else 'bytes'}"
    for k in mine:                                  # C's blocks: its own bytes or evicted, never others'
        got = outcome(c.path / f"c/{k:04x}.bin")
        assert got in (content(k), errno.ENOENT), k
    in_held = [k for k in mine if tier_of(c.path / f"c/{k:04x}.bin") == "remote"]
    assert in_held

    a.mount()                                       # A restarted: a new epoch and another region
    assert share(a)["epoch"] == epoch_a + 1 and share(a)["region"] not in (region_a, -1)
    assert share(a)["fenced"] == ""
    for r in on_a:
        assert outcome(a.path / r) in (errno.ENOENT, errno.EIO), r
    res = run_kvfs("remote", "status", status_url, "--json", "--lease", str(LEASE))
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    reg = {r["region"]: r for r in st["regions"]}[region_a]
    assert reg["owner_slots"] == [share(c)["slot"]] and reg["taken_over_from"]["node_id"] == "node-a"
    nodes = {n["node_id"]: n for n in st["nodes"]}
    assert nodes["node-a"]["epoch"] == epoch_a + 1 and nodes["node-a"]["state"] == "alive"
    assert nodes["node-c"]["regions"] == sorted([share(c)["region"], region_a])
    for m in (a, b, c):
        m.umount()


@pytest.mark.mount
def test_taker_frees_the_dead_nodes_blocks_on_a_file_volume(kvfs_mount, tmp_path):
    vol = str(tmp_path / "shared.img")
    scenario(kvfs_mount, tmp_path, lambda n: vol, vol, remote_size="96MiB")


@pytest.mark.mount
@pytest.mark.target
@pytest.mark.slow
def test_taker_frees_the_dead_nodes_blocks_on_nvmet(kvfs_mount, fresh_target, tmp_path):
    url = fresh_target.url
    sep = "&" if "?" in url else "?"
    scenario(kvfs_mount, tmp_path, lambda n: f"{url}{sep}hostnqn=nqn.2024-01.io.kvfs:node-{n}&timeout=2",
             f"{url}{sep}hostnqn=nqn.2024-01.io.kvfs:status", max_nodes=8)   # regions of ~30 MiB
