"""The kvfs SGLang HiCache backend, driven by SGLang 0.5.23's released storage layer.

The backend is created by SGLang's own ``StorageBackendFactory`` (``dynamic`` backend, the
recipe's extra config) and driven by the controller's released batch loops
(``_page_backup``, ``_page_transfer`` and the page get/set functions they select) on threads
of their own, against a real kvfs mount. See tests/support/released.py.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from kvfs.proc import pid_alive
from support.mount import lazy_unmount, wait_for
from support.released import load_sglang, storage_config

pytestmark = pytest.mark.mount

REPO = Path(__file__).resolve().parents[2]
MODULE = {"backend_name": "kvfs", "module_path": "kvfs.integrations.sglang", "class_name": "KvfsHiCacheStorage"}
MIB = 1 << 20


@pytest.fixture(scope="module")
def sg():
    return load_sglang()


@pytest.fixture
def opened(kvfs_mount):
    """Backends made by the test, closed before its mounts are torn down (an open control
    file keeps a detached daemon alive)."""
    backends = []
    yield backends
    for b in backends:
        b.close()


def _extra(root, **kw) -> dict:
    return {**MODULE, "interface_v1": 1, "root": str(root), **kw}


def _backend(sg, pool, extra, opened, **cfg):
    """Created and attached the way SGLang's controller does it."""
    conf = storage_config(sg.hicache_storage, extra=extra, layout=pool.layout, **cfg)
    backend = sg.StorageBackendFactory.create_backend("dynamic", conf, pool)
    backend.register_mem_pool_host(pool)
    opened.append(backend)
    return backend, sg.Controller(backend, pool, backend_type="dynamic", extra_config=extra)


def _pool(sg, pages, *, page_bytes=MIB, layout="page_first", layers=4):
    # 2 (K, V) * layers * page_size * heads(4) * dim(64) * 2 bytes = page_bytes
    page_size = page_bytes // (2 * layers * 4 * 64 * 2)
    return sg.HostPool(pages=pages, page_size=page_size, layer_num=layers, head_num=4, head_dim=64, layout=layout)


def _keys(n, salt="a"):
    return [f"{salt}{i:063x}"[-64:] for i in range(n)]


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _fill(pool, n, seed=0):
    return [_as_bytes(pool.fill(i * pool.page_size, seed * 10_000 + i)) for i in range(n)]


def _indices(pool, first_page, n):
    return torch.arange(first_page * pool.page_size, (first_page + n) * pool.page_size, dtype=torch.int64)


def _read_back(pool, first_page, n):
    return [_as_bytes(pool.get_data_page((first_page + i) * pool.page_size, flat=True)) for i in range(n)]


@pytest.mark.parametrize("layout,interface_v1", [("page_first", 1), ("layer_first", 1), ("page_first_direct", 1),
                                                 ("page_head", 1), ("layer_first", 0)])
def test_pages_round_trip(sg, kvfs_mount, opened, layout, interface_v1):
    """Backup then prefetch through the released controller loops: every page equal, the
    hit query stops at the first missing page, pages of 1 MiB come back over the lease."""
    m = kvfs_mount(ram="128MiB")
    n = 12
    pool = _pool(sg, 2 * n, layout=layout)
    extra = _extra(m.path / "sglang", interface_v1=interface_v1)
    backend, ctl = _backend(sg, pool, extra, opened)
    want = _fill(pool, n)
    keys = _keys(n)
    assert ctl.on_thread(ctl.backup, keys, _indices(pool, 0, n), name="hicache-backup") == n * pool.page_size
    assert ctl.on_thread(ctl.hit_query, keys + _keys(3, "b"), name="hicache-prefetch") == keys
    assert ctl.hit_query(_keys(3, "b") + keys) == []
    pool.kv_buffer.zero_()
    assert ctl.on_thread(ctl.prefetch, "r1", keys, _indices(pool, n, n)) == n
    assert _read_back(pool, n, n) == want
    st = backend.statistics()
    assert (st.hits, st.misses, st.bytes_read) == (n, 0, n * pool.page_bytes)
    assert st.written == n and st.bytes_written == n * pool.page_bytes
    assert st.lease_fallbacks == 0          # 1 MiB pages in the RAM tier: all read beside FUSE
    assert st.errors == 0
    # a missing page in the middle: the transfer stops there, the pages before it count
    os.unlink(Path(backend._store.dir if interface_v1 else backend._store_for(pool.page_bytes).dir)
              / f"{keys[5]}.bin")
    assert ctl.hit_query(keys) == keys[:5]
    pool.kv_buffer.zero_()
    assert ctl.on_thread(ctl.prefetch, "r2", keys, _indices(pool, n, n)) == 5
    assert _read_back(pool, n, 5) == want[:5]


def test_big_batches_and_small_pages(sg, kvfs_mount, opened):
    """More pages than one storage batch (128), of 128 KiB (below the RAM tier's mapping
    size: no lease fast path, read by one .kvfs/get per batch, none through the mount)."""
    m = kvfs_mount(ram="128MiB")
    n = 150
    pool = _pool(sg, 2 * n, page_bytes=128 << 10)
    backend, ctl = _backend(sg, pool, _extra(m.path / "sglang"), opened)
    want = _fill(pool, n, seed=1)
    keys = _keys(n)
    assert ctl.on_thread(ctl.backup, keys, _indices(pool, 0, n)) == n * pool.page_size
    assert ctl.hit_query(keys) == keys
    pool.kv_buffer.zero_()
    assert ctl.on_thread(ctl.prefetch, "r", keys, _indices(pool, n, n)) == n
    assert _read_back(pool, n, n) == want
    st = backend.statistics()
    assert st.hits == n and st.batch_reads == n and st.lease_fallbacks == 0 and st.errors == 0
    # a second backup of the same pages writes nothing (one lookup per batch finds them)
    assert ctl.backup(keys, _indices(pool, 0, n)) == n * pool.page_size
    assert backend.statistics().skipped == n


def test_nvme_tier_pages_and_checksum(sg, kvfs_mount, opened):
    """Pages demoted to NVMe are leased as O_DIRECT files and verified; a damaged RAM-tier
    page is a miss (and counted), never an exception."""
    m = kvfs_mount(ram="8MiB")
    n = 16
    pool = _pool(sg, 2 * n)
    backend, ctl = _backend(sg, pool, _extra(m.path / "sglang"), opened)
    want = _fill(pool, n, seed=2)
    keys = _keys(n)
    assert ctl.on_thread(ctl.backup, keys, _indices(pool, 0, n)) == n * pool.page_size
    tiers = {os.getxattr(Path(backend._store.dir) / f"{k}.bin", "user.kvfs.tier").decode() for k in keys}
    assert "nvme" in tiers
    pool.kv_buffer.zero_()
    assert ctl.on_thread(ctl.prefetch, "r", keys, _indices(pool, n, n)) == n
    assert _read_back(pool, n, n) == want
    assert backend.statistics().lease_fallbacks == 0
    # damage the backing file of a page that sits in the RAM tier (shared memory), once the
    # promotions the prefetch may have started are done (a demotion would free that copy)
    wait_for(lambda: m.stats()["settled"], 120, "promotion and demotion to settle")
    ram_key = next(k for k in reversed(keys)
                   if os.getxattr(Path(backend._store.dir) / f"{k}.bin", "user.kvfs.tier") == b"ram")
    fd = os.open(Path(backend._store.dir) / f"{ram_key}.bin", os.O_RDONLY)
    try:
        backing = json.loads(os.getxattr(fd, "user.kvfs.backing"))
    finally:
        os.close(fd)
    with open(backing["path"], "r+b") as f:
        f.seek(backing["offset"] + 4096)
        b = f.read(1)
        f.seek(backing["offset"] + 4096)
        f.write(bytes([b[0] ^ 0xFF]))
    ok = ctl.on_thread(backend.batch_get_v1, [ram_key], _indices(pool, n, 1))
    assert ok == [False]
    st = backend.statistics()
    assert st.checksum_errors == 1 and st.errors == 1


def test_killed_daemon_mid_run_gives_misses(sg, kvfs_mount, opened):
    """A prefetch thread looping over the pages while the daemon is SIGKILLed: it sees
    misses, never an exception; nothing is written under the dead mount point; a new daemon
    on the same mount point is picked up again."""
    m = kvfs_mount(ram="64MiB")
    n = 8
    pool = _pool(sg, 2 * n)
    backend, ctl = _backend(sg, pool, _extra(m.path / "sglang"), opened)
    want = _fill(pool, n, seed=3)
    keys = _keys(n)
    assert ctl.backup(keys, _indices(pool, 0, n)) == n * pool.page_size
    results, stop, errors = [], threading.Event(), []

    def prefetcher():
        try:
            while not stop.is_set():
                hits = ctl.hit_query(keys)
                got = ctl.prefetch("r", keys, _indices(pool, n, n))
                results.append((len(hits), got))
        except BaseException as e:      # noqa: BLE001 -- the assertion below reports it
            errors.append(e)
    t = threading.Thread(target=prefetcher, name="hicache-prefetch")
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not results and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.005)
        assert results and results[0] == (n, n)
        m.kill9()
        seen = len(results)
        while (len(results) < seen + 3 or results[-1] != (0, 0)) and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.005)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert results[-1] == (0, 0)
    # stores fail quietly and leave the (now plain) mount point directory alone
    assert ctl.backup(keys, _indices(pool, 0, n)) == 0
    assert os.listdir(m.path) == []
    st = backend.statistics()
    assert st.errors > 0 and st.reconnects > 0
    # a new daemon (same state): the backend reconnects by itself
    m.mount()
    assert ctl.backup(keys, _indices(pool, 0, n)) == n * pool.page_size
    pool.kv_buffer.zero_()
    assert ctl.prefetch("r2", keys, _indices(pool, n, n)) == n
    assert _read_back(pool, n, n) == want


def test_unmount_gives_misses(sg, kvfs_mount, opened):
    """The way a busy FUSE mount is unmounted (lazily: ``umount -l``, ``fusermount3 -u -z``):
    the backend notices its directory left the mount, closes its control files (so the
    detached daemon can exit), and answers misses; nothing is written under the mount point."""
    m = kvfs_mount()
    n = 4
    pool = _pool(sg, 2 * n)
    backend, ctl = _backend(sg, pool, _extra(m.path / "sglang"), opened)
    _fill(pool, n)
    keys = _keys(n)
    assert ctl.backup(keys, _indices(pool, 0, n)) == n * pool.page_size
    assert ctl.hit_query(keys) == keys
    pid = m.pid
    lazy_unmount(m.path)
    assert ctl.on_thread(ctl.hit_query, keys) == []
    assert ctl.on_thread(ctl.prefetch, "r", keys, _indices(pool, n, n)) == 0
    assert ctl.on_thread(ctl.backup, keys, _indices(pool, 0, n)) == 0
    assert backend.exists(keys[0]) is False
    assert os.listdir(m.path) == []
    wait_for(lambda: not pid_alive(pid), 60, "the detached daemon to exit")


def test_stopped_daemon_times_out_to_misses(sg, kvfs_mount, opened):
    """A daemon that stops answering (SIGSTOP) blocks the thread whose request it holds;
    once that request has waited past ``stall_timeout``, the other threads get misses at once
    instead of queueing behind it; when the daemon resumes, everything works again."""
    m = kvfs_mount()
    pool = _pool(sg, 4)
    backend, ctl = _backend(sg, pool, _extra(m.path / "sglang", stall_timeout=0.2), opened)
    _fill(pool, 2)
    keys = _keys(2)
    assert ctl.backup(keys, _indices(pool, 0, 2)) == 2 * pool.page_size
    store = backend._store
    blocked: dict = {}
    os.kill(m.pid, signal.SIGSTOP)
    try:
        # a read asks the daemon (a hit's existence is answered from the name table)
        t = threading.Thread(target=lambda: blocked.setdefault("hits", ctl.prefetch("r0", keys, _indices(pool, 2, 2))))
        t.start()
        wait_for(lambda: any(time.monotonic() - t0 > 0.2 for t0 in list(store._inflight.values())), 60,
                 "a request to wait past the stall timeout")
        assert ctl.on_thread(ctl.hit_query, keys) == []
        assert ctl.on_thread(ctl.prefetch, "r", keys, _indices(pool, 2, 2)) == 0
        assert ctl.on_thread(ctl.backup, _keys(2, "e"), _indices(pool, 0, 2)) == 0
        st = backend.statistics()
        assert st.stalled >= 3 and st.errors == 0
    finally:
        os.kill(m.pid, signal.SIGCONT)
    t.join(60)
    assert blocked["hits"] == 2              # the held request completes when the daemon resumes
    assert ctl.hit_query(keys) == keys
    assert ctl.prefetch("r2", keys, _indices(pool, 2, 2)) == 2


def test_key_isolation(sg, kvfs_mount, opened):
    """Model, TP rank, page geometry and namespace separate pages; MLA KV is one copy shared
    by the TP ranks and written by the storage-writer rank only."""
    m = kvfs_mount()
    root = m.path / "sglang"
    keys = _keys(3)
    pool = _pool(sg, 6)
    a, actl = _backend(sg, pool, _extra(root), opened, model="org/A", tp_rank=0, tp_size=2)
    _fill(pool, 3)
    assert actl.backup(keys, _indices(pool, 0, 3)) == 3 * pool.page_size
    assert a.batch_exists(keys) == 3
    others = [
        _backend(sg, pool, _extra(root), opened, model="org/B", tp_rank=0, tp_size=2)[0],
        _backend(sg, pool, _extra(root), opened, model="org/A", tp_rank=1, tp_size=2)[0],
        _backend(sg, pool, _extra(root, namespace="tenant-2"), opened, model="org/A", tp_rank=0, tp_size=2)[0],
        _backend(sg, _pool(sg, 6, layout="layer_first", layers=8), _extra(root), opened, model="org/A", tp_rank=0,
                 tp_size=2)[0],
    ]
    for o in others:
        assert o.batch_exists(keys) == 0
        assert o.batch_get_v1(keys, _indices(pool, 3, 3)) == [False] * 3
    same = _backend(sg, _pool(sg, 6), _extra(root), opened, model="org/A", tp_rank=0, tp_size=2)[0]
    assert same.batch_exists(keys) == 3
    # MLA: rank 1 (not the storage writer) stores nothing, rank 0 stores for both
    r1, r1ctl = _backend(sg, pool, _extra(root), opened, model="org/M", tp_rank=1, tp_size=2, mla=True)
    assert r1ctl.backup(keys, _indices(pool, 0, 3)) == 3 * pool.page_size
    assert r1.batch_exists(keys) == 0
    r0, r0ctl = _backend(sg, pool, _extra(root), opened, model="org/M", tp_rank=0, tp_size=2, mla=True)
    assert r0ctl.backup(keys, _indices(pool, 0, 3)) == 3 * pool.page_size
    assert r1.batch_exists(keys) == 3


def test_counters_and_metrics(sg, kvfs_mount, opened):
    m = kvfs_mount()
    pool = _pool(sg, 4)
    backend, ctl = _backend(sg, pool, _extra(m.path / "sglang"), opened)
    keys = _keys(2)
    _fill(pool, 2)
    ctl.backup(keys, _indices(pool, 0, 2))
    assert backend.batch_exists(keys + _keys(1, "c")) == 2
    assert backend.batch_get_v1(_keys(2, "d"), _indices(pool, 2, 2)) == [False, False]
    st = backend.statistics()
    assert (st.lookup_hits, st.lookup_misses) == (2 + 0, 1 + 2)   # the backup's lookup found none
    assert (st.gets, st.hits, st.misses) == (2, 0, 2)
    assert backend.get_stats() is None          # SGLang asks only with --enable-storage-metrics


def _recipe() -> list[str]:
    text = (REPO / "docs" / "integrations.md").read_text()
    block = re.search(r"<!-- recipe:sglang -->\s*```sh\n(.*?)```", text, re.S).group(1)
    line = next(cmd for cmd in block.replace("\\\n", " ").splitlines() if "sglang.launch_server" in cmd)
    return shlex.split(line)


def _released_flags(path: Path) -> dict[str, list | None]:
    """``--flag`` -> choices (None: free value) of the released ServerArgs fields file."""
    flags = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            choices = None
            for call in ast.walk(node.annotation):
                if isinstance(call, ast.Call):
                    for kw in call.keywords:
                        if kw.arg == "choices":
                            try:
                                choices = ast.literal_eval(kw.value)
                            except ValueError:      # computed choices: not checked
                                choices = None
            flags["--" + node.target.id.replace("_", "-")] = choices
    return flags


def test_recipe_as_documented(sg, kvfs_mount, opened):
    """docs/integrations.md's SGLang command: every HiCache flag exists in the released
    server arguments with an allowed value, and its extra config, given to the released
    factory, makes a working kvfs backend."""
    argv = _recipe()
    flags = _released_flags(sg.pkg / "srt" / "arg_groups" / "fields" / "memory.py")
    hicache = {}
    i = argv.index("sglang.launch_server") + 1
    while i < len(argv):
        flag = argv[i]
        val = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        i += 2 if val is not None else 1
        if flag == "--model-path":
            continue
        assert flag in flags, f"{flag} is not an SGLang {sg.version} flag"
        if flags[flag] is not None:
            assert val in flags[flag], f"{flag} {val}: not one of {flags[flag]}"
        hicache[flag] = val
    assert hicache["--hicache-storage-backend"] == "dynamic"
    extra = json.loads(hicache["--hicache-storage-backend-extra-config"])
    m = kvfs_mount()
    extra["root"] = str(m.path / "sglang")       # the recipe's /mnt/kvfs, here
    pool = _pool(sg, 4, layout=hicache["--hicache-mem-layout"])
    backend, ctl = _backend(sg, pool, extra, opened)
    assert type(backend).__module__ == "kvfs.integrations.sglang"
    assert ctl.page_get_func.__name__ == "_page_get_zero_copy"
    want = _fill(pool, 2)
    assert ctl.backup(_keys(2), _indices(pool, 0, 2)) == 2 * pool.page_size
    assert ctl.prefetch("r", _keys(2), _indices(pool, 2, 2)) == 2
    assert _read_back(pool, 2, 2) == want
