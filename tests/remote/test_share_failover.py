"""Node failures on a shared volume, through real daemons and mounts (docs/scale-out.md).

One scenario, run on a file volume (fast) and on the real nvmet-tcp target (its own VM):
1. kill -9 A while a writer loop is appending blocks; A restarts (same node id, a new epoch):
   B and A agree on A's blocks (the names on A's remote tier are exactly the names B's view
   shows, every read on B byte-equal to A's or a miss);
2. A SIGSTOPped past its lease: C (the only node that takes over) claims A's region and
   republishes its blocks, B reads them byte-equal through C's publication; A after SIGCONT
   is fenced, its demotions stay local or fail cleanly and nothing of it reaches its old
   region (checked on the volume, byte for byte);
3. on the target: the target restarts; B and C reconnect and keep serving, A stays fenced.
"""
from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
from pathlib import Path

import pytest
import trio

from support.files import put, tier_of
from support.mount import run_kvfs, wait_for
from support.share import MiB, caught_up, content, outcome, share

LEASE = 6.0


def config(tmp_path: Path, name: str, takeover: bool) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(f"share = true\nshare_poll = 0.1\nshare_max_nodes = 4\nshare_lease = {LEASE}\n"
                 f"share_takeover = {'true' if takeover else 'false'}\n")
    return p


def region_digest(url: str, region: int) -> str:
    """sha256 of one data region, read from the volume by a probe of our own."""
    from kvfs.remote import make_volume
    from kvfs.remote.share import format as F

    async def go() -> str:
        vol = make_volume(url, instance_id="probe")
        await vol.open()
        try:
            sb2 = F.Superblock2.unpack(await vol.read(0, max(4096, vol.block_size)))
            h, off = hashlib.sha256(), sb2.region_off(region)
            end = off + sb2.region_bytes
            while off < end:
                n = min(4 << 20, end - off)
                h.update(bytes(await vol.read(off, n)))
                off += n
            return h.hexdigest()
        finally:
            await vol.close()
    return trio.run(go)


def files_of(m) -> dict[str, str | None]:
    """Every block file under the mount -> its tier (None: gone meanwhile)."""
    out = {}
    for d, _dirs, names in os.walk(m.path):
        if "/.kvfs" in d + "/":
            continue
        for n in names:
            p = Path(d) / n
            out[str(p.relative_to(m.path))] = tier_of(p)
    return out


def writer(root: Path, start: int, stop: threading.Event, done: list) -> None:
    i = start
    while not stop.is_set():
        try:
            put(root / f"w/{i % 8:03x}/blk{i:05d}.bin", content(i))
        except OSError:
            return                      # the daemon is gone (killed) or refuses: the loop ends
        done.append(i)
        i += 1


def scenario(kvfs_mount, tmp_path, url_of, probe_url: str, target=None, **extra) -> None:
    mk = dict(ram="8MiB", nvme_size="16MiB", **extra)
    a = kvfs_mount(remote=url_of("a"), config=config(tmp_path, "a", False), node_id="node-a", **mk)
    b = kvfs_mount(remote=url_of("b"), config=config(tmp_path, "b", False), node_id="node-b", **mk)

    # 1. kill -9 A mid-append, restart it: A and B agree on A's blocks
    stop, done = threading.Event(), []
    t = threading.Thread(target=writer, args=(a.path, 0, stop, done), daemon=True)
    t.start()
    try:
        wait_for(lambda: share(a)["published"] >= 12, 240, "A to publish blocks while writing")
        a.kill9()
    finally:
        stop.set()
        t.join(60)
    a.mount()
    wait_for(lambda: a.stats()["settled"] and caught_up(b, a), 120, "A to settle and B to tail A's log")

    def agree() -> bool:
        # a record committed just before the kill, not yet in A's index, is freed by A's
        # start-up sweep (published): B agrees once it has tailed that too
        return caught_up(b, a) and {p for p, t in files_of(a).items() if t == "remote"} == set(files_of(b))
    try:
        wait_for(agree, 60, "B's view to equal A's remote names")
    except AssertionError:
        on_a, on_b = {p for p, t in files_of(a).items() if t == "remote"}, set(files_of(b))
        raise AssertionError(f"A and B disagree on {sorted(on_a ^ on_b)[:10]}: {share(a)} {share(b)}") from None
    on_a = {p: tier for p, tier in files_of(a).items() if tier == "remote"}
    assert on_a
    for p in on_a:
        got = outcome(b.path / p)
        assert got == outcome(a.path / p) or got in (errno.ENOENT, errno.EIO), p
    print(f"kill -9 mid-append: {len(done)} blocks written, {len(on_a)} on the volume, B agrees")

    # 2. A frozen past its lease: C takes its region over, B reads A's blocks through C
    c = kvfs_mount(remote=url_of("c"), config=config(tmp_path, "c", True), node_id="node-c", **mk)
    region_a = share(a)["region"]
    os.kill(a.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: share(c)["takeovers"] == 1, 120, "C to take A's region over")
        assert list(share(c)["held"]) == [str(region_a)] and share(b)["takeovers"] == 0
        frozen = region_digest(probe_url, region_a)
        wait_for(lambda: caught_up(b, c), 60, "B to tail C's republication")
        peers = share(b)["tail"]["peers"]
        for p in on_a:
            assert outcome(b.path / p) == written(p), p
        assert "node-c" in peers
    finally:
        os.kill(a.pid, signal.SIGCONT)
    wait_for(lambda: "taken over" in share(a)["fenced"], 60, "A to find its region taken over")
    for i in range(10_000, 10_024):           # more than A's RAM + NVMe: demotions would reach the volume
        try:
            put(a.path / f"late/blk{i}.bin", content(i))
        except OSError as e:
            assert e.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT), e
    wait_for(lambda: a.stats()["settled"], 120, "A to settle after the late writes")
    assert region_digest(probe_url, region_a) == frozen, "the fenced node wrote to the region it lost"
    assert a.stats()["tiers"]["remote"]["state"] == "fenced"
    shown = run_kvfs("stat", c.path)                  # (words compared: the table may wrap lines)
    assert shown.returncode == 0 and f"holding region {region_a} from node-a" in " ".join(shown.stdout.split())
    shown = " ".join(run_kvfs("stat", a.path).stdout.split())
    assert "remote share lease: 6 s + grace 3 s, fenced: region" in shown, shown

    if target is not None:
        target_restart(target, a, b, c, on_a)
    for m in (a, b, c):
        m.umount()


def target_restart(target, a, b, c, on_a: dict) -> None:
    """3. The target restarts: B and C reconnect and keep serving; A stays fenced."""
    reconnects = {m: m.stats()["tiers"]["remote"]["reconnects"] for m in (b, c)}
    target.kill()
    target.start()
    for m in (b, c):
        wait_for(lambda m=m: m.stats()["tiers"]["remote"]["reconnects"] > reconnects[m]
                 and m.stats()["tiers"]["remote"]["state"] == "connected", 180, f"{m} to reconnect")
    for p in list(on_a)[:8]:
        assert outcome(b.path / p) == written(p), p
    put(c.path / "after/restart.bin", content(99_999))
    assert outcome(c.path / "after/restart.bin") == content(99_999)
    assert a.stats()["tiers"]["remote"]["state"] == "fenced"


def written(p: str) -> bytes:
    """The bytes the writer loop wrote to block ``p`` (from its seed). ``blkN.bin.tmp``: the
    temp file of a put that kill -9 caught between its close (sealed, whole) and its rename."""
    return content(int(Path(p).name.split(".")[0][3:]))


@pytest.mark.mount
def test_kill_freeze_takeover_on_a_file_volume(kvfs_mount, tmp_path):
    vol = str(tmp_path / "shared.img")
    scenario(kvfs_mount, tmp_path, lambda n: vol, vol, remote_size="256MiB")


@pytest.mark.mount
@pytest.mark.target
@pytest.mark.slow
def test_kill_freeze_takeover_target_restart_on_nvmet(kvfs_mount, fresh_target, tmp_path):
    url = fresh_target.url
    sep = "&" if "?" in url else "?"
    scenario(kvfs_mount, tmp_path, lambda n: f"{url}{sep}hostnqn=nqn.2024-01.io.kvfs:node-{n}&timeout=2",
             f"{url}{sep}hostnqn=nqn.2024-01.io.kvfs:probe", target=fresh_target)
