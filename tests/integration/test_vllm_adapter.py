"""The kvfs vLLM tier, driven by vLLM 0.33.0's released offloading tier layer.

The tier is created by vLLM's own ``SecondaryTierFactory`` from the recipe's tier config,
beside vLLM's own ``fs`` tier (``FileSystemTierManager``) on the same directory, and driven
the way vLLM's tiering manager drives its secondary tiers: per-chunk ``lookup`` answered
RETRY until the tier's lookup thread has resolved the step's batch (the scheduler's released
``_maximal_prefix_lookup`` scans a request's chunks), ``on_schedule_end`` once per step,
``submit_store``/``submit_load`` with ``TransferJob``s naming primary-tier slots, and
``get_finished_jobs`` polled until the job is reported. Only the wheel (336 MB) is large: these
tests run in ``make test-integration``, not in the default ``make test`` (marker
``vllm_wheel``). See tests/support/released.py.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfs.proc import pid_alive
from support.drivers import VllmDriver, vllm_spec, vllm_tier
from support.mount import lazy_unmount, wait_for
from support.released import load_sglang, load_vllm, storage_config

pytestmark = [pytest.mark.mount, pytest.mark.vllm_wheel]

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
TIER = {"type": "KvfsTierManager", "module_path": "kvfs.integrations.vllm"}


@pytest.fixture(scope="module")
def v():
    v = load_vllm()
    import kvfs.integrations.vllm  # noqa: F401 -- importable once vLLM is
    return v


@pytest.fixture
def tiers():
    made = []
    yield made
    for t in made:
        t.shutdown()


def _tier(v, tiers, root, *, chunks=16, chunk_bytes=MIB, kind=None, **spec_kw):
    """A tier made by vLLM's factory over a fresh primary tier; returns its driver."""
    config = dict(kind or TIER, root_dir=str(root))
    if config["type"] == "fs":
        config.update(n_read_threads=2, n_write_threads=2)
    d = vllm_tier(v, config, chunks=chunks, chunk_bytes=chunk_bytes, wait=wait_for, **spec_kw)
    tiers.append(d.tier)
    return d


def _keys(v, n, salt="a", group=0):
    return [v.base.make_offload_key(hashlib.sha256(f"{salt}{i}".encode()).digest(), group) for i in range(n)]


def test_chunks_round_trip(v, kvfs_mount, tiers):
    """Cascade then promotion: every chunk equal, misses are misses, one lookup per request
    per step, 1 MiB chunks leased (no fallback); a chunk gone mid-chain ends the hit run and
    a load job keeps the chunks before it."""
    m = kvfs_mount(ram="128MiB")
    n = 12
    d = _tier(v, tiers, m.path / "vllm", chunks=2 * n)
    keys = _keys(v, n)
    want = d.fill(range(n), seed=1)
    assert d.store(keys, range(n)).success
    assert d.hits(keys + _keys(v, 3, "b")) == n
    assert d.hits(_keys(v, 3, "b") + keys) == 0
    st = d.tier.statistics()
    # the store's own lookup, then one per request: the first request's chunks in one round
    # trip; the second's absent first chunk from the name table (table_misses) when its cached
    # directory inodes are fresh (stat-ed within the last second), else one round trip
    assert st.lookups == 1 + 2
    # an absent first chunk is a MISS in the scheduler's own step: no RETRY, nothing queued
    # (the directory's inode cached by the blocking probe just before; a new request and key
    # each try, in case a stalled machine let the second pass before the table may answer)
    verdicts = []
    for i, key in enumerate(_keys(v, 5, "c")):      # a new request each try (its first chunk)
        ctx = v.base.ReqContext(req_id=f"fresh{i}")
        d.tier.on_new_request(ctx)
        assert d.tier.store.prefix([d.tier.name(key)]) == 0
        verdicts.append(d.tier.lookup(key, ctx))
        if verdicts[-1] == v.base.LookupResult.MISS:
            break
        d.tier.on_request_finished(ctx)
    assert verdicts[-1] == v.base.LookupResult.MISS, verdicts
    assert d.tier.lookup(keys[0], ctx) == v.base.LookupResult.RETRY     # a hit needs the round trip
    d.tier.on_request_finished(ctx)
    res = d.load(keys, range(n, 2 * n))
    assert res.success and res.transfer_bytes == n * MIB
    assert d.read(range(n, 2 * n)) == want
    st = d.tier.statistics()
    assert (st.hits, st.misses, st.lease_fallbacks, st.errors) == (n, 0, 0, 0)
    assert st.written == n and st.bytes_written == n * MIB
    # a chunk vanishes (evicted): the hit run ends there; a load job keeps the chunks before it
    os.unlink(d.tier.file_mapper.get_file_name(keys[5]))
    assert d.hits(keys) == 5
    d.primary[n:] = 0
    res = d.load(keys, range(n, 2 * n))
    assert not res.success and list(res.successful_keys) == keys[:5]
    assert d.read(range(n, n + 5)) == want[:5]
    # a second store of the same chunks writes only what is missing after the present run
    before = d.tier.statistics()
    assert d.store(keys, range(n)).success
    after = d.tier.statistics()
    assert (after.skipped - before.skipped, after.written - before.written) == (5, n - 5)


def test_shares_a_directory_with_vllms_fs_tier(v, kvfs_mount, tiers):
    """vLLM's own ``fs`` tier and the kvfs tier on one directory: same file names, each
    reads back exactly what the other wrote."""
    m = kvfs_mount(ram="128MiB")
    root = m.path / "cache"
    fs = _tier(v, tiers, root, kind={"type": "fs"})
    kv = _tier(v, tiers, root)
    assert kv.tier.dir == f"{fs.tier.file_mapper.base_path}_r0"
    a, b = _keys(v, 6, "fs"), _keys(v, 6, "kv")
    want_a = fs.fill(range(6), seed=2)
    assert fs.store(a, range(6)).success
    want_b = kv.fill(range(6), seed=3)
    assert kv.store(b, range(6)).success
    for k in b:
        assert os.path.isfile(fs.tier.file_mapper.get_file_name(k))
    assert kv.hits(a) == 6 and fs.hits(b) == 6
    assert kv.load(a, range(6, 12)).success and kv.read(range(6, 12)) == want_a
    assert fs.load(b, range(6, 12)).success and fs.read(range(6, 12)) == want_b
    assert kv.tier.statistics().lease_fallbacks == 0   # the fs tier's chunks are leased too
    assert json.loads(Path(kv.tier.file_mapper.get_config_file_path()).read_text())["model_name"] == "org/Model-8B"


def test_small_chunks_and_nvme_tier(v, kvfs_mount, tiers):
    """128 KiB chunks (below the RAM tier's mapping size: no lease fast path, read by one
    .kvfs/get) and 1 MiB chunks demoted to the NVMe tier (O_DIRECT leases)."""
    m = kvfs_mount(ram="8MiB")
    small = _tier(v, tiers, m.path / "vllm", chunks=40, chunk_bytes=128 << 10, model="org/Small")
    keys = _keys(v, 20, "s")
    want = small.fill(range(20), seed=4)
    assert small.store(keys, range(20)).success
    assert small.hits(keys) == 20
    assert small.load(keys, range(20, 40)).success and small.read(range(20, 40)) == want
    st = small.tier.statistics()   # too small to lease: one .kvfs/get, none through the mount
    assert (st.batch_reads, st.lease_fallbacks) == (20, 0)
    big = _tier(v, tiers, m.path / "vllm", chunks=32)
    keys = _keys(v, 16, "n")
    want = big.fill(range(16), seed=5)
    assert big.store(keys, range(16)).success
    tiers_of = {os.getxattr(big.tier.file_mapper.get_file_name(k), "user.kvfs.tier").decode() for k in keys}
    assert "nvme" in tiers_of
    assert big.load(keys, range(16, 32)).success and big.read(range(16, 32)) == want
    st = big.tier.statistics()
    assert st.lease_fallbacks == 0 and st.errors == 0


def test_killed_daemon_mid_run_gives_misses(v, kvfs_mount, tiers):
    """A scheduler looping lookups and loads while the daemon is SIGKILLed: misses and failed
    jobs, never an exception; nothing written under the dead mount point; a new daemon is
    picked up by itself."""
    m = kvfs_mount(ram="64MiB")
    n = 8
    d = _tier(v, tiers, m.path / "vllm", chunks=2 * n)
    keys = _keys(v, n)
    want = d.fill(range(n), seed=6)
    assert d.store(keys, range(n)).success
    results, stop, errors = [], threading.Event(), []

    def scheduler():
        try:
            while not stop.is_set():
                results.append((d.hits(keys), d.load(keys, range(n, 2 * n)).success))
        except BaseException as e:      # noqa: BLE001 -- reported below
            errors.append(e)
    t = threading.Thread(target=scheduler, name="vllm-scheduler")
    t.start()
    try:
        wait_for(lambda: results or not t.is_alive(), 60, "a first lookup and load")
        assert results[0] == (n, True)
        m.kill9()
        seen = len(results)
        wait_for(lambda: (len(results) >= seen + 3 and results[-1] == (0, False)) or not t.is_alive(), 60,
                 "misses after the kill")
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert results[-1] == (0, False)
    assert not d.store(_keys(v, 2, "late"), range(2)).success
    assert os.listdir(m.path) == []
    st = d.tier.statistics()
    assert st.errors > 0 and st.reconnects > 0
    m.mount()                           # a new daemon (the RAM tier's chunks died with the old one)
    assert d.hits(keys) == 0
    assert d.store(keys, range(n)).success and d.hits(keys) == n
    d.primary[n:] = 0
    assert d.load(keys, range(n, 2 * n)).success and d.read(range(n, 2 * n)) == want


def test_tier_starting_as_the_mount_dies_writes_nothing_under_it(v, kvfs_mount, tiers, monkeypatch):
    """The daemon killed and its mount detached after the starting tier found its page store
    on kvfs but before it made the directory of ``config.json``: the tier starts, every store
    fails, and nothing is made under the bare mount point (the directory and ``config.json``
    were once written on the disk below)."""
    from kvfs.integrations.pages import PageStore
    m = kvfs_mount(ram="64MiB")
    real, killed = PageStore.on_kvfs, []

    def on_kvfs_then_killed(store):
        on = real.fget(store)
        if not killed:
            killed.append(on)
            m.kill9()                    # the daemon dies right after the tier found it
        return on
    monkeypatch.setattr(PageStore, "on_kvfs", property(on_kvfs_then_killed))
    d = _tier(v, tiers, m.path / "vllm", chunks=4)
    assert killed == [True] and not os.path.ismount(m.path)
    assert os.listdir(m.path) == []
    d.fill(range(2), seed=3)
    assert not d.store(_keys(v, 2), range(2)).success
    assert os.listdir(m.path) == []


def test_config_is_not_written_under_a_mount_that_died_after_its_directory_was_made(v, kvfs_mount, tiers,
                                                                                    monkeypatch):
    """Issue 32 (4): the daemon killed and its mount detached right after the starting tier
    made the directory of ``config.json`` through the mount, and the same directory present on
    the disk below: ``config.json`` goes through a descriptor of the mount's root, so it is
    not written there (by path it was)."""
    from kvfs.integrations.pages import PageStore
    m = kvfs_mount(ram="64MiB")
    real, killed = PageStore.makedirs, []

    def made_then_killed(store, path):
        real(store, path)
        if not killed:
            killed.append(path)
            m.kill9()
            os.makedirs(path, exist_ok=True)     # the same directory on the disk below
    monkeypatch.setattr(PageStore, "makedirs", made_then_killed)
    _tier(v, tiers, m.path / "vllm", chunks=4)
    assert killed and not os.path.ismount(m.path)
    files = [os.path.join(d, f) for d, _, fs in os.walk(m.path) for f in fs]
    assert files == [], f"written under the bare mount point: {files}"


def test_unmount_gives_misses(v, kvfs_mount, tiers):
    """A lazily unmounted mount: misses, failed jobs, nothing written under the mount point,
    and the detached daemon exits (the tier closed its control files)."""
    m = kvfs_mount()
    d = _tier(v, tiers, m.path / "vllm", chunks=8)
    keys = _keys(v, 4)
    d.fill(range(4), seed=7)
    assert d.store(keys, range(4)).success
    pid = m.pid
    lazy_unmount(m.path)
    assert d.hits(keys) == 0
    assert not d.load(keys, range(4, 8)).success
    assert not d.store(_keys(v, 2, "u"), range(2)).success
    assert os.listdir(m.path) == []
    wait_for(lambda: not pid_alive(pid), 60, "the detached daemon to exit")


def test_key_isolation_with_sglang(v, kvfs_mount, tiers):
    """SGLang's and vLLM's adapters pointed at one directory of one mount: each sees only its
    own pages for the same block hashes (the page formats differ); vLLM instances of one
    model configuration share chunks, other models, dtypes and TP ranks do not (TP ranks do
    where vLLM says the KV is parallelism-agnostic)."""
    sg = load_sglang()
    m = kvfs_mount(ram="128MiB")
    root = m.path / "cache"
    hashes = [hashlib.sha256(f"shared{i}".encode()).digest() for i in range(3)]
    vkeys = [v.base.make_offload_key(h, 0) for h in hashes]
    skeys = [h.hex() for h in hashes]
    a = _tier(v, tiers, root, chunks=6)
    a.fill(range(3), seed=8)
    assert a.store(vkeys, range(3)).success
    pool = sg.HostPool(pages=6, page_size=MIB // (2 * 4 * 4 * 64 * 2), layer_num=4, head_num=4, head_dim=64,
                       layout="page_first")
    extra = {"backend_name": "kvfs", "module_path": "kvfs.integrations.sglang", "class_name": "KvfsHiCacheStorage",
             "interface_v1": 1, "root": str(root)}
    backend = sg.StorageBackendFactory.create_backend(
        "dynamic", storage_config(sg.hicache_storage, model="org/Model-8B", extra=extra, layout="page_first"), pool)
    backend.register_mem_pool_host(pool)
    try:
        assert backend.batch_exists(skeys) == 0             # vLLM's chunks are not SGLang pages
        ctl = sg.Controller(backend, pool, backend_type="dynamic", extra_config=extra)
        for i in range(3):
            pool.fill(i * pool.page_size, i)
        assert ctl.backup(skeys, torch.arange(0, 3 * pool.page_size)) == 3 * pool.page_size
        assert backend.batch_exists(skeys) == 3
        assert a.hits(vkeys) == 3                            # and SGLang's pages are not vLLM chunks
    finally:
        backend.close()
    assert _tier(v, tiers, root, chunks=6).hits(vkeys) == 3             # a second vLLM, same config
    for other in (dict(model="org/Other"), dict(dtype="float16"), dict(tp_size=2, rank=1)):
        assert _tier(v, tiers, root, chunks=6, **other).hits(vkeys) == 0, other
    # vLLM's names leave the chunk size out (the model config fixes it): a tier with other
    # chunks finds the names, but a chunk of the wrong size is a miss, never wrong bytes
    odd = _tier(v, tiers, root, chunks=6, chunk_bytes=512 << 10)
    assert odd.hits(vkeys) == 3
    res = odd.load(vkeys, range(3))
    assert not res.success and res.successful_keys is None      # no slot counts as loaded
    # parallelism-agnostic KV (vLLM decides): TP ranks share one directory
    ag0 = _tier(v, tiers, root, chunks=6, tp_size=2, rank=0, agnostic=True)
    ag0.fill(range(3), seed=9)
    assert ag0.store(vkeys, range(3)).success
    assert _tier(v, tiers, root, chunks=6, tp_size=2, rank=1, agnostic=True).hits(vkeys) == 3


def test_stopped_daemon_times_out_to_misses(v, kvfs_mount, tiers):
    """A stopped daemon (SIGSTOP) holds the lookup thread's request; loads and stores after
    ``stall_timeout`` fail at once instead of queueing behind it."""
    m = kvfs_mount()
    primary = np.zeros((8, MIB), dtype=np.uint8)
    config = dict(TIER, root_dir=str(m.path / "vllm"), stall_timeout=0.2)
    tier = v.tier_factory.SecondaryTierFactory.create_secondary_tier(config, memoryview(primary), vllm_spec(v))
    tiers.append(tier)
    d = VllmDriver(v, tier, primary, wait_for)
    keys = _keys(v, 2)
    d.fill(range(2), seed=10)
    assert d.store(keys, range(2)).success
    import signal
    os.kill(m.pid, signal.SIGSTOP)
    try:
        ctx = v.base.ReqContext(req_id="held")
        assert tier.lookup(keys[0], ctx) is v.base.LookupResult.RETRY
        d.step(ctx)                                     # the lookup thread's request is now held
        wait_for(lambda: any(time.monotonic() - t0 > 0.2 for t0 in list(tier.store._inflight.values())), 60,
                 "a request to wait past the stall timeout")
        assert not d.load(keys, range(2, 4)).success
        assert not d.store(_keys(v, 2, "s"), range(2)).success
        st = tier.statistics()
        assert st.stalled >= 2 and st.errors == 0
    finally:
        os.kill(m.pid, signal.SIGCONT)
    assert d.hits(keys) == 2
    assert d.load(keys, range(2, 4)).success


def _recipe() -> list[str]:
    text = (REPO / "docs" / "integrations.md").read_text()
    block = re.search(r"<!-- recipe:vllm -->\s*```sh\n(.*?)```", text, re.S).group(1)
    line = next(cmd for cmd in block.replace("\\\n", " ").splitlines() if "vllm serve" in cmd)
    return shlex.split(line)


def test_recipe_as_documented(v, kvfs_mount, tiers):
    """docs/integrations.md's vLLM command: ``--kv-transfer-config`` is a released engine
    argument, its connector is registered in the released connector factory, its spec in the
    released spec factory, and its tier config, given to the released tier factory, makes a
    working kvfs tier."""
    argv = _recipe()
    flag = argv.index("--kv-transfer-config")
    src = (v.root / "vllm/engine/arg_utils.py").read_text()
    assert '"--kv-transfer-config"' in src
    conf = json.loads(argv[flag + 1])
    registered = set()
    for node in ast.walk(ast.parse((v.root / "vllm/distributed/kv_transfer/kv_connector/factory.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_connector":
            registered.add(ast.literal_eval(node.args[0]))
    assert conf["kv_connector"] in registered
    kv_roles = re.search(r'KVProducer = Literal\[(.*?)\]', (v.root / "vllm/config/kv_transfer.py").read_text()).group(1)
    assert f'"{conf["kv_role"]}"' in kv_roles
    extra = conf["kv_connector_extra_config"]
    assert extra["spec_name"] in v.spec_factory.OffloadingSpecFactory._registry
    assert isinstance(extra["cpu_bytes_to_use"], int)
    (tier_conf,) = extra["secondary_tiers"]
    m = kvfs_mount()
    tier_conf = dict(tier_conf, root_dir=str(m.path / "vllm"))     # the recipe's /mnt/kvfs, here
    assert v.tier_factory.SecondaryTierFactory.get_tier_class(tier_conf).__module__ == "kvfs.integrations.vllm"
    d = _tier(v, tiers, m.path / "vllm", kind={k: tier_conf[k] for k in ("type", "module_path")}, chunks=4)
    want = d.fill(range(2), seed=11)
    keys = _keys(v, 2)
    assert d.store(keys, range(2)).success and d.hits(keys) == 2
    assert d.load(keys, range(2, 4)).success and d.read(range(2, 4)) == want
