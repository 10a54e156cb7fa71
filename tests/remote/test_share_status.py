"""``kvfs remote status``: the operator's view of a shared volume, through the CLI.

Two live daemons on one file volume: the command reads the volume on its own (read-only,
the daemons keep running) and shows both nodes, their regions and fill, the log heads, and
with ``--mount`` the view lag of that node. After both unmount, the same command shows
them dead and leaves the volume byte-for-byte unchanged. Errors are one line.
"""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from support.files import put, tier_of
from support.mount import run_kvfs, wait_for
from support.share import caught_up, content, share

from kvfs.remote import volume_format as L


def status(*args) -> dict:
    res = run_kvfs("remote", "status", *map(str, args), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.mount
def test_status_of_a_shared_volume_with_two_live_daemons(kvfs_mount, tmp_path):
    vol = tmp_path / "shared.img"
    cfg = tmp_path / "share.toml"
    cfg.write_text("share = true\nshare_poll = 0.1\nshare_max_nodes = 2\n")
    a = kvfs_mount(ram="8MiB", nvme_size="16MiB", remote=str(vol), config=cfg, node_id="node-a",
                   remote_size="256MiB")
    b = kvfs_mount(ram="8MiB", nvme_size="16MiB", remote=str(vol), config=cfg, node_id="node-b",
                   remote_size="256MiB")
    files = [a.path / f"kv/{i:02x}.bin" for i in range(32)]
    for i, p in enumerate(files):
        put(p, content(i))
    wait_for(lambda: sum(tier_of(p) == "remote" for p in files) >= 4 and a.stats()["settled"], 180,
             "A to demote blocks to the shared volume")
    wait_for(lambda: caught_up(b, a), 60, "B to tail A's log")
    sa, sb = share(a), share(b)

    st = status(vol, "--mount", b.path)
    nodes = {n["node_id"]: n for n in st["nodes"]}
    assert set(nodes) == {"node-a", "node-b"} and st["max_nodes"] == 2 and st["format"] == 2
    for s, n in ((sa, nodes["node-a"]), (sb, nodes["node-b"])):
        assert (n["slot"], n["epoch"], n["regions"], n["lost_regions"]) == (s["slot"], s["epoch"], [s["region"]], [])
        assert n["state"] == "alive" and n["heartbeat_age"] < 60
    assert nodes["node-a"]["log"]["head"] == sa["log_next_seq"] >= 5
    assert not nodes["node-a"]["log"]["wrapped"] and nodes["node-a"]["log"]["capacity"] == 2048
    regions = {r["region"]: r for r in st["regions"]}
    ra = regions[sa["region"]]
    remote = a.stats()["tiers"]["remote"]
    assert ra["owner_slots"] == [sa["slot"]] and ra["objects"] == remote["objects"] >= 4
    assert ra["used"] == remote["used"] and 0 < ra["fill"] < 1
    assert regions[sb["region"]]["objects"] == 0
    view = st["view"]
    assert view["node_id"] == "node-b" and view["peers"]["node-a"]["behind"] == 0
    assert not view["peers"]["node-a"]["needs_rescan"]
    # the table form names both nodes (the daemons are still running)
    res = run_kvfs("remote", "status", vol)
    assert res.returncode == 0 and "node-a" in res.stdout and "node-b" in res.stdout, res.stderr
    assert a.stats()["tiers"]["remote"]["state"] == "connected"

    a.umount()
    b.umount()
    before = hashlib.sha256(vol.read_bytes()).hexdigest()
    st = status(vol, "--lease", "0.01", "--grace", "0")
    assert {n["node_id"]: n["state"] for n in st["nodes"]} == {"node-a": "dead", "node-b": "dead"}
    assert hashlib.sha256(vol.read_bytes()).hexdigest() == before


def test_status_errors_are_one_line(tmp_path):
    one = tmp_path / "one.img"
    sb = L.Superblock.plan(region=64 << 20, lba_size=512, owner="x", created=0.0)
    with open(one, "wb") as f:
        f.write(sb.pack())
        f.truncate(64 << 20)
    blank = tmp_path / "blank.img"
    with open(blank, "wb") as f:
        f.truncate(16 << 20)
    # a port nobody listens on: connection refused at once
    for target, msg in ((one, "single-node (format 1)"), (blank, "blank"), (tmp_path / "none.img", "does not exist"),
                        ("nvme-tcp://127.0.0.1:9/nqn.2024-01.io.kvfs:none?timeout=1", "cannot reach")):
        res = run_kvfs("remote", "status", target)
        assert res.returncode == 1 and msg in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = run_kvfs("remote", "status", one, "--lease", "0")
    assert res.returncode == 1 and "--lease" in res.stderr
    assert not os.path.exists(tmp_path / "none.img")
