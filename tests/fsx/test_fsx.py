"""The fsx-style exerciser (tests/support/fsx.py) against real kvfs mounts with tiny tiers.

Default run: 1500 operations with 1 process, and with 2 processes in 2 phases with a kill -9
and remount between them; RAM 4 MiB and NVMe 16 MiB so demotion and eviction run during the
sequence; every operation kind; every difference from the reference directory fails except
the documented ones (see fsx.py).

Slow runs (``make test-slow``): at least 1M operations in all, across seeds and process
counts, in phases with kill -9 of the daemon and a remount between them; after each kill
every file must be exactly its last sealed version or absent.

Random tiers (``test_fsx_random_tiers``): each seed mounts with its own tier sizes
(``fsx.tier_sizes``: RAM 4 MiB to 1 GiB), since what a descriptor reads must not depend on
them; ``FSX_SEEDS=101,102 FSX_OPS=10000`` runs those seeds with 1 and 4 processes instead of
the short default (``FSX_PHASES=4``: in 4 phases, with a kill -9 and remount between two;
``FSX_PASSTHROUGH=1``: with FUSE passthrough on, as the short runs always are).

``FSX_RESULTS=FILE`` appends one JSON line per run (seed, processes, operations, seconds,
tiers, counts) for ``tests/fsx/plot_fsx.py``, which draws docs/fsx.png.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from support import fsx  # noqa: E402
from support.mount import wait_for  # noqa: E402

pytestmark = pytest.mark.mount

TINY = {"ram": "4MiB", "nvme_size": "16MiB"}


def _record(seed: int, procs: int, ops: int, seconds: float, summary: dict, phases: int, known_broken: bool,
            tiers: dict | None = None):
    path = os.environ.get("FSX_RESULTS")
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"seed": seed, "procs": procs, "ops": ops, "seconds": seconds, "phases": phases, "tiers": tiers,
                            "known_broken_excluded": known_broken, "counts": summary["counts"],
                            "mismatches": summary["mismatches"][:20]}) + "\n")


def run_fsx(m, ref, *, seed: int, procs: int, ops: int, phases: int = 1, exclude=(), max_mismatches=200,
            tiers: dict | None = None):
    """``phases`` runs of ``ops / phases`` operations; between two phases the daemon is killed
    with SIGKILL (workers keep their descriptors open through it), remounted, and every file
    checked against its last sealed version."""
    transport = m.stats()["transport"]
    pt = transport.get("passthrough", {}).get("state", "off")
    cfg = fsx.Config(str(m.path), str(ref), seed=seed, procs=procs, ops=ops, exclude=tuple(sorted(exclude)),
                     max_mismatches=max_mismatches, passthrough=pt.startswith("on"))
    ex = fsx.Exerciser(cfg)
    t0 = time.perf_counter()
    try:
        for phase in range(phases):
            ex.run(ops // phases)
            if phase < phases - 1:
                expected = ex.pause()
                # the kernel sends FUSE_RELEASE after close(2) returns: a version is sealed once
                # the daemon has the release of every other writer (see fsx.Exerciser.pause)
                wait_for(lambda: m.stats()["open_handles"] == ex.open_handles, 120,
                         "the daemon to process every FUSE_RELEASE")
                m.kill9()
                m.mount()
                ex.verify(expected)
        ex.finish()
    finally:
        ex.close()
    seconds = time.perf_counter() - t0
    summary = fsx.summarize(ex.reports)
    _record(seed, procs, ops, seconds, summary, phases, bool(exclude), tiers)
    c = summary["counts"]
    print(f"fsx seed {seed} procs {procs} tiers {tiers or TINY} transport {transport['name']} "
          f"passthrough {pt.split()[0]}: {c.get('ops', 0)} ops in {seconds:.1f} s "
          f"({c.get('ops', 0) / seconds:.0f}/s), evicted {c.get('evicted', 0)}, mismatches {c.get('mismatch', 0)}, "
          f"after kill -9: intact {c.get('crash_intact', 0)} absent {c.get('crash_absent', 0)}")
    return summary


def _no_mismatch(summary):
    assert not summary["mismatches"], "\n".join(summary["mismatches"][:30])


@pytest.mark.parametrize("procs,seed,phases", [(1, 1, 1), (2, 2, 2)])
def test_fsx_short(kvfs_mount, tmp_path, procs, seed, phases):
    """1500 operations with FUSE passthrough on; with 2 processes in 2 phases, a kill -9 and
    remount between them."""
    m = kvfs_mount("--passthrough", **TINY)
    s = run_fsx(m, tmp_path / "ref", seed=seed, procs=procs, ops=1500, phases=phases, exclude=fsx.KNOWN_BROKEN)
    _no_mismatch(s)
    c = s["counts"]
    assert c["ops"] >= 1500 - procs * phases
    kinds = set(fsx.WEIGHTS)
    assert all(c.get(k, 0) > 0 for k in kinds - {"readdir"}), {k: c.get(k, 0) for k in kinds}
    if phases > 1:
        assert c.get("crash_intact", 0) > 0, c
    else:
        st = m.stats()["tiers"]
        assert st["ram"]["demotions"] > 0, "no demotion ran during the sequence: the tiers are not tiny enough"


def test_fsx_crash_model_counts_the_seal_by_an_mmap_close(kvfs_mount, tmp_path):
    """The 'unexplained' crash mismatches (seeds 31 and 36, 2 in ~960 files): Python's mmap
    dups the descriptor and closes the dup when the mapping closes; that close(2) is a
    FUSE_FLUSH, which seals when the handle is the only writer, so a kill -9 later keeps the
    version written before the mapping — the reference must accept it."""
    m = kvfs_mount(ram="4MiB", nvme_size="64MiB")      # a 6 MiB buffer spills: sealed on NVMe
    w = fsx.Worker(fsx.Config(str(m.path), str(tmp_path / "ref"), seed=5), 0)
    w._open("f00", os.O_RDWR, True, False, False, False)
    w._write(w.handles[-1], w.data(6 << 20), 0, "bulk_write")
    w.op_close(w.handles[-1])
    wait_for(lambda: os.getxattr(w.kp("f00"), "user.kvfs.tier") == b"nvme", 60, "f00 on NVMe")
    w._open("f00", os.O_RDWR, False, False, False, False)
    h = w.handles[-1]
    w._write(h, w.data(64 << 10), 1 << 20, "pwrite")
    w._mmap(h, False)                                   # maps, reads, unmaps: seals
    w._write(h, w.data(64 << 10), 3 << 20, "pwrite")    # not sealed
    expected = w.expected_after_crash()
    m.kill9()
    m.mount()
    w.verify_after_crash(expected)
    assert not w.mismatches, w.mismatches
    assert w.counts["crash_intact"] == 1 and w.counts["crash_mismatch"] == 0, dict(w.counts)


def test_fsx_old_version_reader_with_o_direct_reads_only_old_bytes(kvfs_mount, tmp_path):
    """An O_DIRECT reader of the old version of a file rewritten and shrunk (seeds 11 and 12
    x 1 process: the model compared such reads as if POSIX; 7 mismatches in 250k operations,
    all of this kind). Since stop 38 the rewrite by the name renews it (docs/design.md,
    "Versions and sizes"): the reader keeps its inode, old bytes and size, and the model
    follows (the reference's file copied and renamed over the name)."""
    m = kvfs_mount()
    w = fsx.Worker(fsx.Config(str(m.path), str(tmp_path / "ref"), seed=5, max_size=192 << 10), 0)
    w._open("f00", os.O_RDWR, True, False, False, False)
    w._write(w.handles[-1], w.data(192 << 10), 0, "bulk_write")
    w.op_close(w.handles[-1])
    w._open("f00", os.O_RDONLY, False, False, False, True)      # the O_DIRECT reader
    w._open("f00", os.O_RDWR, False, False, False, False)       # a new version, by the name
    wr = w.handles[-1]
    assert not w.handles[0].frozen and w.counts["renewed"] == 1
    assert os.fstat(wr.kfd).st_ino != os.fstat(w.handles[0].kfd).st_ino
    for fd in (wr.kfd, wr.rfd):
        os.ftruncate(fd, 8192)
    w.op_close(wr)
    for _ in range(8):
        w.op_odirect()
    w.close_all()                # (an open descriptor would hold the detached daemon at teardown)
    assert not w.mismatches, w.mismatches
    assert w.counts["mismatch"] == 0


@pytest.mark.parametrize("ram", ["8MiB", "64MiB"])
def test_fsx_rdonly_creat_reader_reads_zeros_to_fstat_size(kvfs_mount, tmp_path, ram):
    """Issue 32's report in the exerciser's terms: a new name opened O_RDONLY|O_CREAT, then
    extended by path; its descriptor was told the new size and read EOF inside it (and its
    mapping faulted with SIGBUS). The model and kvfs now agree: zeros up to fstat's size."""
    m = kvfs_mount(ram=ram, nvme_size="64MiB")
    w = fsx.Worker(fsx.Config(str(m.path), str(tmp_path / "ref"), seed=5), 0)
    w._open("f06", os.O_RDONLY, True, False, False, False)
    h = w.handles[-1]
    w.begin_session(h.rino)                          # what op_truncate does, with the report's size
    for p in (w.kp("f06"), w.rp("f06")):
        os.truncate(p, 1_872_697)
    w.end_session_if_done(h.rino)
    assert h.frozen and os.fstat(h.kfd).st_size == 1_872_697
    w.check("pread", fsx._call(os.pread, h.kfd, 2931, 1_064_312), (True, bytes(2931)))
    for _ in range(8):
        w._mmap(h, False)
        w.op_pread()
    w.close_all()
    assert not w.mismatches, w.mismatches


def _seeds() -> list[tuple[int, int]]:
    seeds = [int(x) for x in os.environ.get("FSX_SEEDS", "").split(",") if x.strip()]
    return [(s, p) for s in seeds for p in (1, 4)] if seeds else [(41, 1), (42, 2)]


@pytest.mark.parametrize("seed,procs", _seeds())
def test_fsx_random_tiers(kvfs_mount, tmp_path, seed, procs):
    """Tier sizes picked per seed (RAM 4 MiB to 1 GiB); every mmap read goes up to fstat's
    size; no mismatch, no worker killed by a signal (``FSX_OPS``: operations per run;
    ``FSX_PHASES``: phases, with a kill -9 and remount between two; ``FSX_PASSTHROUGH=1``:
    mounted with ``--passthrough``; ``KVFS_TRANSPORT=pyfuse3``: on the fallback transport)."""
    tiers = fsx.tier_sizes(seed)
    m = kvfs_mount(*(("--passthrough",) if os.environ.get("FSX_PASSTHROUGH") == "1" else ()), **tiers)
    s = run_fsx(m, tmp_path / "ref", seed=seed, procs=procs, ops=int(os.environ.get("FSX_OPS", "1500")),
                phases=int(os.environ.get("FSX_PHASES", "1")), tiers=tiers)
    _no_mismatch(s)
    assert s["counts"].get("mmap_read", 0) > 0


def test_fsx_exercises_every_kind_and_agrees_with_itself(tmp_path):
    """The exerciser itself, on two plain directories with the POSIX model: without
    exclusions every op kind, the known-broken variants included, is chosen, and two POSIX
    filesystems give no mismatch (the comparisons raise no false alarm)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    cfg = fsx.Config(str(a), str(b), seed=3, ops=3000, posix=True)
    w = fsx.Worker(cfg, 0)
    w.run(3000)
    assert not w.mismatches, w.mismatches[:10]
    missing = [k for k in fsx.ALL_KINDS if not w.counts.get(k)]
    assert not missing, missing


# -- long runs --------------------------------------------------------------------------
LONG = [(seed, procs) for seed in (11, 12, 31, 36) for procs in (1, 4)]   # 8 x 126k >= 1M ops


@pytest.mark.slow
@pytest.mark.parametrize("seed,procs", LONG)
def test_fsx_long_with_kill9_phases(kvfs_mount, tmp_path, seed, procs):
    m = kvfs_mount(**TINY)
    s = run_fsx(m, tmp_path / "ref", seed=seed, procs=procs, ops=126_000, phases=20, exclude=fsx.KNOWN_BROKEN)
    _no_mismatch(s)



# Seeds no earlier run was tuned on (issue 32): 20 seeds x (1 and 4 processes) x 5,000 ops =
# 200,000 ops, each seed on its own random tiers (tiny to 1 GiB RAM), in 4 phases with a
# kill -9 and remount between two. Every file is its last sealed version or absent after a kill.
UNSEEN = [(seed, procs) for seed in range(501, 521) for procs in (1, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("seed,procs", UNSEEN)
def test_fsx_unseen_seeds_random_tiers_with_kill9(kvfs_mount, tmp_path, seed, procs):
    tiers = fsx.tier_sizes(seed)
    m = kvfs_mount(**tiers)
    s = run_fsx(m, tmp_path / "ref", seed=seed, procs=procs, ops=5_000, phases=4, tiers=tiers)
    _no_mismatch(s)
