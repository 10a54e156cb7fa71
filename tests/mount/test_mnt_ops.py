"""Operating a mount: Prometheus metrics scraped over HTTP, KV events read while another process
writes, admission (admit_after), ``kvfs top`` in a pseudo-terminal. Real mounts, real daemon."""
from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.files import MiB, content, put, read
from support.mount import run_kvfs, scrape, wait_for

from support.files import direct_read
from support.mount import _env, kvfs_command
from kvfs.blockformat import build_header

pytestmark = pytest.mark.mount


def settled(m) -> dict:
    return wait_for(lambda: (lambda s: s if s["settled"] else None)(m.stats()), 120, "the store to settle")


def hx(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def block(ns: str, h: str, parent: str, tokens: int, payload: int) -> bytes:
    """A kvfs block file (kvfs-block-v1 header, random payload)."""
    meta = {"format": "kvfs-block-v1", "kvfs.namespace": ns, "kvfs.hash": h, "kvfs.parent": parent,
            "kvfs.tokens": str(tokens), "kvfs.block_tokens": "16"}
    return build_header(meta, {"kv": ("U8", [payload], payload)}) + content(h, payload)


def chain(ns: str, n: int, payload: int = 64 << 10) -> list[tuple[str, str, int, bytes]]:
    """``n`` chained blocks: (hash, parent, tokens, bytes)."""
    out, parent = [], ""
    for i in range(n):
        h = hx(f"{ns}-{i}")
        out.append((h, parent, 16 * (i + 1), block(ns, h, parent, 16 * (i + 1), payload)))
        parent = h
    return out


def block_path(root, ns: str, h: str):
    return root / ns / h[:2] / f"{h}.kv"


# ---- metrics -------------------------------------------------------------------------------
def test_metrics_scraped_while_writing_and_reading(kvfs_mount):
    m = kvfs_mount(ram="8MiB", metrics="127.0.0.1:0")
    before = scrape(m)
    assert before[("kvfs_tier_capacity_bytes", ("ram",))] == 8 * MiB
    assert ("process_resident_memory_bytes", ()) in before
    blocks = chain("modelA", 12, payload=MiB)
    for h, _, _, data in blocks:
        put(block_path(m.path, "modelA", h), data)
    settled(m)
    for h, _, _, data in blocks:
        assert read(block_path(m.path, "modelA", h)) == data
    h, _, _, data = blocks[0]                       # past the kernel's page cache
    assert read_direct(block_path(m.path, "modelA", h), len(data)) == data
    # a block read through FUSE passthrough never reaches the daemon; a small one (kept in the
    # daemon's memory, no tier file) always does: a FUSE read on either transport
    small = m.path / "modelA" / "small.kv"
    put(small, b"s" * 4096)
    assert read_direct(small, 4096) == b"s" * 4096         # past the page cache the write filled
    assert not os.path.exists(block_path(m.path, "modelA", hx("not there")))
    ans = _lease(m, [f"modelA/{h[:2]}/{h}.kv" for h, *_ in blocks[:3]] + ["modelA/00/none.kv"])
    assert ans["prefix"] == 3
    for _ in range(10):     # the two snapshots of one state (a lease's RELEASE comes after close)
        st = settled(m)
        after = scrape(m)
        now = m.stats()["tiers"]
        if all(now[t]["used"] == st["tiers"][t]["used"] for t in ("ram", "nvme")):
            break

    def delta(name, *labels):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    total = sum(len(d) for *_, d in blocks)
    assert after[("kvfs_namespace_bytes", ("modelA",))] == total + 4096        # and the small file
    assert after[("kvfs_namespace_blocks", ("modelA",))] == 12 + 1
    assert delta("kvfs_namespace_hits_total", "modelA") >= 12 + 3          # opens and leased blocks
    assert delta("kvfs_namespace_misses_total", "modelA") >= 2             # the stat and the lease's tail
    # sealed in RAM, or on NVMe when a buffer spilled there (RAM full), then demoted
    assert delta("kvfs_tier_written_bytes_total", "ram") + delta("kvfs_tier_written_bytes_total", "nvme") >= total
    assert delta("kvfs_tier_written_bytes_total", "ram") > 0
    assert delta("kvfs_tier_demotions_total", "ram") > 0                   # 12 MiB through 8 MiB of RAM
    assert delta("kvfs_tier_hits_total", "ram") + delta("kvfs_tier_hits_total", "nvme") >= 12
    assert delta("kvfs_tier_read_bytes_total", "nvme") > 0
    for tier in ("ram", "nvme"):
        assert after[("kvfs_tier_used_bytes", (tier,))] == st["tiers"][tier]["used"]
        assert after[("kvfs_tier_objects", (tier,))] == st["tiers"][tier]["objects"]
    assert after[("kvfs_tier_used_bytes", ("ram",))] <= 8 * MiB
    for hist in ("lookup", "fuse_read", "fuse_write", "seal", "lease"):
        assert delta(f"kvfs_{hist}_duration_seconds_count") > 0, hist
        assert after[(f"kvfs_{hist}_duration_seconds_bucket", ("+Inf",))] == \
            after[(f"kvfs_{hist}_duration_seconds_count", ())]
    assert delta("kvfs_seal_duration_seconds_count") >= 12
    assert after[("kvfs_events_total", ("stored",))] - before[("kvfs_events_total", ("stored",))] >= 12
    assert after[("kvfs_settled", ())] in (0, 1)


def read_direct(path, size: int) -> bytes:
    """Read ``size`` bytes (a multiple of 4096) with O_DIRECT into a page-aligned buffer."""
    buf = mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = os.preadv(fd, [buf], 0)
        return bytes(buf[:n])
    finally:
        os.close(fd)
        buf.close()


def _lease(m, paths: list[str]) -> dict:
    fd = os.open(m.path / ".kvfs" / "lease", os.O_RDWR)
    try:
        os.write(fd, ("\n".join(paths) + "\n").encode())
        return json.loads(os.pread(fd, 1 << 20, 0))
    finally:
        os.close(fd)


def test_metrics_address_errors_are_one_line(kvfs_cli, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = kvfs_cli("mount", mp, "--nvme", tmp_path / "nvme", "--metrics", "localhost:http")
    assert res.returncode != 0 and not os.path.ismount(mp)
    assert res.stderr.strip().count("\n") == 0 and "metrics address" in res.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = kvfs_cli("mount", mp, "--nvme", tmp_path / "nvme", "--ram", "16MiB",
                       "--metrics", f"127.0.0.1:{port}")
    assert res.returncode != 0 and not os.path.ismount(mp)
    assert "cannot serve metrics" in res.stderr and res.stderr.strip().count("\n") == 0


# ---- events ---------------------------------------------------------------------------------
_WRITER = """
import os, sys
from pathlib import Path
for path, src in zip(sys.argv[1::2], sys.argv[2::2]):
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(Path(src).read_bytes())
    os.replace(tmp, p)
"""


def _events(fd: int, want, limit: int = 10_000) -> list[dict]:
    """Read events from ``fd`` until ``want(events)`` holds (idle lines are skipped)."""
    got: list[dict] = []
    buf = b""
    for _ in range(limit):
        chunk = os.read(fd, 1 << 16)
        assert chunk, "end of file on .kvfs/events"
        buf += chunk
        *lines, buf = buf.split(b"\n")
        got += [e for e in map(json.loads, lines) if e["event"] != "idle"]
        if want(got):
            return got
    raise AssertionError(f"events never matched: {got}")


def test_events_follow_another_process_writing(kvfs_mount, tmp_path):
    m = kvfs_mount(ram="4MiB")
    blocks = chain("modelB", 6, payload=MiB)
    args = []
    for h, _, _, data in blocks:
        src = tmp_path / h
        src.write_bytes(data)
        args += [str(block_path(m.path, "modelB", h)), str(src)]
    fd = os.open(m.path / ".kvfs" / "events", os.O_RDONLY)
    try:
        assert m.stats()["events"]["readers"] == 1
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, *args])
        evs = _events(fd, lambda g: sum(e["event"] == "stored" for e in g) >= 6
                      and any(e["event"] == "demoted" for e in g))
        assert writer.wait(timeout=120) == 0
        stored = [e for e in evs if e["event"] == "stored"]
        assert [(e["hash"], e["parent"] or "", int(e["tokens"])) for e in stored] == \
            [(h, p, t) for h, p, t, _ in blocks]
        assert all(e["namespace"] == "modelB" and e["tier"] in ("ram", "nvme") for e in stored)
        demoted = [e for e in evs if e["event"] == "demoted"]
        assert all(e["tier"] == "nvme" and e["hash"] in {h for h, *_ in blocks} for e in demoted)
        seqs = [e["seq"] for e in evs]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        gone = blocks[-1][0]
        os.unlink(block_path(m.path, "modelB", gone))
        evs = _events(fd, lambda g: any(e["event"] == "removed" for e in g))
        removed = [e for e in evs if e["event"] == "removed"]
        assert removed[0]["hash"] == gone and removed[0]["path"].endswith(f"{gone}.kv")
    finally:
        os.close(fd)
    wait_for(lambda: m.stats()["events"]["readers"] == 0, 30, "the reader to be gone")


def test_slow_event_reader_loses_events_not_writes(kvfs_mount, tmp_path):
    cfg = tmp_path / "kvfs.toml"
    cfg.write_text("events_queue = 8\n")
    m = kvfs_mount(config=cfg)
    fd = os.open(m.path / ".kvfs" / "events", os.O_RDONLY)
    try:
        (m.path / "slow").mkdir()
        for i in range(30):                      # nobody reads meanwhile: the writes go on
            (m.path / "slow" / f"f{i}").write_bytes(content(f"f{i}", 4096))
        evs = _events(fd, lambda g: len(g) >= 9)
        assert evs[0]["event"] == "dropped" and evs[0]["count"] == 30 - 8
        assert [e["path"] for e in evs[1:]] == [f"/slow/f{i}" for i in range(22, 30)]
        assert m.stats()["events"]["dropped"] == 22
    finally:
        os.close(fd)


def test_kvfs_events_command(kvfs_mount, tmp_path):
    m = kvfs_mount()
    proc = subprocess.Popen([*kvfs_command(), "events", str(m.path), "--count", "2"],
                            stdout=subprocess.PIPE, text=True, env=_env())
    try:
        wait_for(lambda: m.stats()["events"]["readers"] == 1, 60, "kvfs events to open the file")
        (m.path / "c").mkdir()
        (m.path / "c" / "one").write_bytes(b"1" * 5000)
        (m.path / "c" / "two").write_bytes(b"2" * 5000)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert [(e["event"], e["path"]) for e in map(json.loads, out.splitlines())] == \
        [("stored", "/c/one"), ("stored", "/c/two")]


def test_events_file_is_read_only_and_bounded(kvfs_mount):
    m = kvfs_mount()
    with pytest.raises(OSError) as e:
        os.open(m.path / ".kvfs" / "events", os.O_WRONLY)
    assert e.value.errno == errno.EACCES
    fds = [os.open(m.path / ".kvfs" / "events", os.O_RDONLY) for _ in range(8)]
    try:
        with pytest.raises(OSError) as e:
            os.open(m.path / ".kvfs" / "events", os.O_RDONLY)
        assert e.value.errno == errno.EBUSY
        idle = json.loads(os.read(fds[0], 4096))            # nothing happens: an idle line
        assert idle["event"] == "idle"
    finally:
        for fd in fds:
            os.close(fd)


def test_other_users_cannot_read_events(kvfs_mount, intruder):
    from support.users import reachable
    m = kvfs_mount(allow_other=True)
    with reachable(m.path):
        res = intruder.run("import os, sys\ntry:\n    os.open(sys.argv[1], os.O_RDONLY)\n"
                           "except OSError as e:\n    print(e.errno)\n", m.path / ".kvfs" / "events")
    assert res.stdout.strip() == str(errno.EACCES)


# ---- admission -------------------------------------------------------------------------------
def test_admit_after_drops_blocks_never_read(kvfs_mount, tmp_path):
    cfg = tmp_path / "kvfs.toml"
    cfg.write_text("[admit_after]\nnvme = 2\n")
    m = kvfs_mount(ram="8MiB", config=cfg, metrics="127.0.0.1:0")
    files = {i: content(f"a{i}", MiB) for i in range(12)}
    for i in range(6):
        put(m.path / "adm" / f"b{i}", files[i])
    settled(m)
    for i in range(3):                              # a second use: these may go to NVMe
        assert read(m.path / "adm" / f"b{i}") == files[i]
    for i in range(6, 12):
        put(m.path / "adm" / f"b{i}", files[i])
    settled(m)
    gone = []
    for i, data in files.items():                   # a file read once is admitted from then on
        try:
            assert read(m.path / "adm" / f"b{i}") == data
        except FileNotFoundError:
            gone.append(i)
    st = settled(m)
    assert {0, 1, 2}.isdisjoint(gone) and {3, 4, 5} <= set(gone)
    assert st["admission_dropped"]["nvme"] == len(gone)
    assert st["tiers"]["ram"]["evictions"] == len(gone)
    assert scrape(m)[("kvfs_tier_admission_dropped_total", ("nvme",))] == len(gone)


def test_bad_admission_and_deadline_settings_are_refused(kvfs_cli, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    for text, word in (("admit_after = 0\n", "admit_after"), ("[admit_after]\nram = 2\n", "admit_after"),
                       ("read_deadline = -1\n", "read_deadline"), ("events_queue = 0\n", "events_queue")):
        cfg = tmp_path / "bad.toml"
        cfg.write_text(text)
        res = kvfs_cli("mount", mp, "--nvme", tmp_path / "nvme", "--config", cfg)
        assert res.returncode != 0 and word in res.stderr and res.stderr.strip().count("\n") == 0


# ---- kvfs top ------------------------------------------------------------------------------------
def _pty_run(argv: list[str], until=None, hang_guard: float = 180) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as stdout; ``until(text)`` true: SIGINT it.

    Reads until the program exits (the pty reports EOF). ``hang_guard`` only stops a program
    that never gets there (it is not a performance bound): the test then fails with the
    output seen so far."""
    master, slave = pty.openpty()
    # started with SIGINT ignored, as a background job of a non-interactive shell (CI) is:
    # Ctrl-C must still stop the view
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env={**_env(), "TERM": "xterm",
                            "COLUMNS": "120", "LINES": "40"}, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    os.close(slave)
    out = b""
    give_up = time.monotonic() + hang_guard
    try:
        while time.monotonic() < give_up:
            r, _, _ = select.select([master], [], [], 0.1)
            if r:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:           # EIO: the other side closed
                    break
                if not chunk:
                    break
                out += chunk
                if until is not None and until(out.decode(errors="replace")):
                    proc.send_signal(signal.SIGINT)
                    until = None
            elif proc.poll() is not None:
                break
        else:
            pytest.fail(f"{argv[-3:]} did not finish (condition met: {until is None}); "
                        f"last output: {out[-2000:].decode(errors='replace')!r}")
        return proc.wait(timeout=hang_guard), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_top_once_in_a_pty(kvfs_mount):
    m = kvfs_mount()
    put(m.path / "topns" / "x", content("x", 300_000))
    rc, out = _pty_run([*kvfs_command(), "top", str(m.path), "--once", "--interval", "0.1"])
    assert rc == 0, out
    for word in ("tiers", "ram", "nvme", "topns", "hit%", "settled"):
        assert word in out, (word, out)


def test_top_live_shows_a_new_namespace(kvfs_mount):
    m = kvfs_mount()
    put(m.path / "first" / "x", content("x", 300_000))
    wrote = []

    def seen(text: str) -> bool:
        if "first" in text and not wrote:
            put(m.path / "later-ns" / "y", content("y", 200_000))
            wrote.append(True)
        return bool(wrote) and "later-ns" in text

    rc, out = _pty_run([*kvfs_command(), "top", str(m.path), "--interval", "0.1"], until=seen)
    assert rc == 0, out
    assert "\x1b[?1049h" in out                     # rich Live took the full screen
    assert "later-ns" in out


# ---- read deadline on a hung local disk --------------------------------------------------------
def test_read_deadline_on_a_hung_nvme_disk(kvfs_mount, tmp_path):
    """The NVMe tier's directory on a filesystem whose server stops answering: another kvfs
    mount whose daemon is stopped (SIGSTOP), so every open and read there blocks in the kernel,
    as on a hung disk. A read of a file that lives only on that NVMe gets EIO at
    ``read_deadline`` (the worker thread stuck on the disk is abandoned), counted per tier;
    after SIGCONT the same file reads back intact."""
    lower = kvfs_mount(ram="256MiB")
    (lower.path / "disk").mkdir()
    cfg = tmp_path / "kvfs.toml"
    cfg.write_text("read_deadline = 1.0\n")
    m = kvfs_mount(ram="4MiB", nvme=lower.path / "disk" / "nvme", config=cfg, metrics="127.0.0.1:0")
    files = {m.path / "ns" / f"b{i}": content(f"hung{i}", MiB) for i in range(8)}
    for p, data in files.items():
        put(p, data)
    wait_for(lambda: settled(m) and any(os.getxattr(p, "user.kvfs.tier") == b"nvme" for p in files),
             120, "files on the NVMe tier")
    victim = next(p for p in files if os.getxattr(p, "user.kvfs.tier") == b"nvme")
    buf = mmap.mmap(-1, 2 * MiB)

    from concurrent.futures import ThreadPoolExecutor, TimeoutError as Hung
    os.kill(lower.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            stalled = pool.submit(direct_read, victim, buf)
            try:    # a hang guard, not a timing check: without the deadline the read never returns
                err = stalled.exception(timeout=90)
            except Hung:
                os.kill(lower.pid, signal.SIGCONT)
                pytest.fail("the read waited for the hung disk past 90 s instead of failing at read_deadline")
        assert isinstance(err, OSError) and err.errno == errno.EIO, err
        assert m.stats()["deadline_exceeded"].get("nvme", 0) >= 1
    finally:
        os.kill(lower.pid, signal.SIGCONT)
    assert direct_read(victim, buf) == files[victim]
    buf.close()
    assert scrape(m)[("kvfs_tier_read_deadline_exceeded_total", ("nvme",))] >= 1
    m.umount()                        # before the filesystem under its NVMe tier goes
